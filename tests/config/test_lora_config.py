"""The `lora:` section: its defaults and the errors that name the key."""

from __future__ import annotations

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.job.preflight import check_lora_targets, validate_before_start
from rl_engine.executors.worker.critic.worker import critic_adapter_seed


def test_lora_is_off_by_default_and_its_scale_is_alpha_over_rank():
    assert not RunConfig().lora.enabled
    lora = RunConfig.from_dict({"lora": {"rank": 16, "alpha": 32}}).lora
    assert lora.enabled and lora.scale == 2.0 and lora.target_modules == "all-linear"
    listed = RunConfig.from_dict({"lora": {"rank": 1, "target_modules": ["q_proj", "v_proj"]}})
    assert listed.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": -1}, r"lora.rank must be an int >= 0, got -1"),
        ({"rank": 4, "dropout": 0.05}, r"lora.dropout must be 0.0, got 0.05: dropout"),
        ({"rank": 4, "alpha": 0}, r"lora.alpha must be a finite number > 0.0"),
        ({"rank": 4, "target_modules": "all"}, r"lora.target_modules must be 'all-linear'"),
        ({"rank": 4, "target_modules": []}, r"lora.target_modules must be 'all-linear' or a non"),
        ({"rank": 4, "scale": 2}, r"lora"),
    ],
)
def test_bad_values_name_the_key(lora, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"lora": lora})


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({"batch_invariant": False, "parity": "off"}, r"lora.rank > 0 needs batch_invariant"),
    ],
)
def test_what_a_lora_policy_cannot_run_with_is_a_config_error(top, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"lora": {"rank": 4}, **top})


def test_a_lora_policy_runs_ppo_with_a_critic_adapter_seeded_apart():
    config = RunConfig.from_dict({"lora": {"rank": 4}, "algorithm": {"name": "ppo"}})
    assert config.lora.enabled and config.algorithm.name == "ppo"
    assert config.critic_view().lora == config.lora  # the critic's adapter: the same keys
    seeds = {critic_adapter_seed(seed) for seed in range(100)}
    assert len(seeds) == 100 and not seeds & set(range(100))
    assert all(0 <= s < 2**63 for s in seeds)


def test_a_critic_model_of_another_spec_gets_its_own_adapter_on_the_same_targets():
    """critic.model set: the critic's adapter sits on that model, so the lora: targets must
    exist there too, checked before Ray starts under the critic.model key."""
    ppo = {"algorithm": {"name": "ppo"}, "critic": {"model": "tiny-mixtral"}}
    validate_before_start(RunConfig.from_dict({"lora": {"rank": 4}, **ppo}))
    listed = {"rank": 4, "target_modules": ["q_proj", "up_proj"]}
    with pytest.raises(ValueError, match=r"critic.model: lora.target_modules: \['up_proj'\]"):
        validate_before_start(RunConfig.from_dict({"lora": listed, **ppo}))


def test_a_lora_policy_runs_on_tensor_parallel_engines():
    config = RunConfig.from_dict({"lora": {"rank": 4}, "rollout": {"tensor_parallel_size": 2}})
    assert config.lora.enabled and config.rollout.tensor_parallel_size == 2


def test_a_target_that_matches_no_module_is_caught_before_ray_listing_the_linears():
    config = RunConfig.from_dict(
        {"model": "tiny-mixtral", "lora": {"rank": 4, "target_modules": ["q_proj", "up_proj"]}}
    )
    with pytest.raises(
        ValueError, match=r"lora.target_modules: \['up_proj'\].*\['k_proj', 'o_proj'"
    ):
        check_lora_targets(config)
    check_lora_targets(RunConfig.from_dict({"model": "tiny-mixtral", "lora": {"rank": 4}}))
