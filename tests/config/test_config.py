"""RunConfig: defaults, YAML round trip, unknown keys, and one ValueError per invalid field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import rl_engine
from rl_engine.config import AlgorithmConfig, RolloutConfig, RunConfig, TrainerConfig
from rl_engine.rollout.sampling import SamplingKeys, SamplingParams
from tests.helpers.imports import forbidden_imports


def test_defaults():
    c = RunConfig()
    assert (c.model, c.dtype, c.device, c.batch_invariant, c.parity) == (
        "tiny-llama",
        "float32",
        "cpu",
        True,
        "strict",
    )
    assert c.torch_dtype is torch.float32
    assert (c.rollout.samples_per_prompt, c.rollout.task, c.rollout.top_k) == (4, "count", 0)
    assert c.trainer.deepspeed == {"zero_optimization": {"stage": 0}, "steps_per_print": 1_000_000}
    assert (
        c.trainer.zero_stage is None
        and c.algorithm.name == "grpo"
        and c.algorithm.rollout_correction == "none"
    )
    assert c.sequences_per_step == 16 and c.gradient_accumulation_steps == 4
    assert c.trainer.packing is True and c.trainer.max_tokens_per_micro_batch == 0
    assert RunConfig(dtype="bfloat16").torch_dtype is torch.bfloat16


def test_sections_do_not_share_mutable_defaults():
    a, b = RunConfig(), RunConfig()
    a.trainer.deepspeed["zero_optimization"]["stage"] = 2
    assert b.trainer.deepspeed["zero_optimization"]["stage"] == 0


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tiny-qwen3\ndtype: bfloat16\nparity: report\nbatch_invariant: false\n"
        "rollout: {samples_per_prompt: 2, temperature: 0.7}\n"
        "trainer: {num_ranks: 2, micro_batch_size: 2, zero_stage: 3, deepspeed: configs/deepspeed/zero3.json}\n"
        "algorithm: {name: grpo, kl_coef: 0.1, rollout_correction: token_truncate, loss_aggregation: seq-mean-token-mean}\n"
    )
    config = RunConfig.from_yaml(path)
    assert (
        config.rollout.temperature == 0.7
        and config.trainer.zero_stage == 3
        and config.algorithm.rollout_correction == "token_truncate"
    )
    config.to_yaml(tmp_path / "again.yaml")
    assert RunConfig.from_yaml(tmp_path / "again.yaml") == config
    assert RunConfig.from_dict(dataclasses.asdict(config)) == config


def test_empty_yaml_gives_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert RunConfig.from_yaml(tmp_path / "empty.yaml") == RunConfig()


def test_unknown_keys_are_listed_with_their_section():
    with pytest.raises(ValueError) as err:
        RunConfig.from_dict(
            {"modle": "x", "trainer": {"lr": 1e-4, "micro_batch": 2}, "rollout": {"topk": 3}}
        )
    message = str(err.value)
    assert "modle" in message and "trainer.micro_batch" in message and "rollout.topk" in message
    assert "micro_batch_size" in message  # the valid keys are listed


def test_section_must_be_a_mapping():
    with pytest.raises(ValueError, match="trainer must be a mapping"):
        RunConfig.from_dict({"trainer": [1, 2]})


INVALID = [
    ({"dtype": "float16"}, "dtype"),
    ({"model": ""}, "model"),
    ({"seed": -1}, "seed"),
    ({"device": "cuda:0"}, "device"),
    ({"batch_invariant": "yes"}, "batch_invariant"),
    ({"parity": "loose"}, "parity"),
    ({"output_dir": ""}, "output_dir"),
    ({"steps": 0}, "steps"),
    ({"rollout": {"num_engines": 0}}, "rollout.num_engines"),
    ({"rollout": {"max_batch_size": 0}}, "rollout.max_batch_size"),
    ({"rollout": {"prompts_per_step": 0}}, "rollout.prompts_per_step"),
    ({"rollout": {"samples_per_prompt": 0}}, "rollout.samples_per_prompt"),
    ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens"),
    ({"rollout": {"temperature": -0.5}}, "rollout.temperature"),
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"rollout": {"top_k": -1}}, "rollout.top_k"),
    ({"rollout": {"task": ""}}, "rollout.task"),
    ({"trainer": {"num_ranks": 0}}, "trainer.num_ranks"),
    ({"trainer": {"micro_batch_size": 0}}, "trainer.micro_batch_size"),
    ({"trainer": {"packing": 1}}, "trainer.packing"),
    ({"trainer": {"max_tokens_per_micro_batch": 2.5}}, "trainer.max_tokens_per_micro_batch"),
    ({"trainer": {"lr": 0}}, "trainer.lr"),
    ({"trainer": {"weight_decay": -0.1}}, "trainer.weight_decay"),
    ({"trainer": {"grad_clip": float("nan")}}, "trainer.grad_clip"),
    ({"trainer": {"deepspeed": 3}}, "trainer.deepspeed"),
    ({"trainer": {"zero_stage": 4}}, "trainer.zero_stage"),
    ({"algorithm": {"name": "reinforce"}}, "algorithm.name"),
    ({"trainer": {"placement": "anywhere"}}, "trainer.placement"),
    ({"trainer": {"collective_timeout_s": 0}}, "trainer.collective_timeout_s"),
    ({"trainer": {"weight_sync_bucket_mb": 0}}, "trainer.weight_sync_bucket_mb"),
    ({"rollout": {"placement": "pack_tight"}}, "rollout.placement"),
    ({"checkpoint": {"every": -1}}, "checkpoint.every"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
    ({"checkpoint": {"weights_only": "no"}}, "checkpoint.weights_only"),
    ({"algorithm": {"clip_eps": 1.0}}, "algorithm.clip_eps"),
    ({"algorithm": {"clip_eps_high": -0.1}}, "algorithm.clip_eps_high"),
    ({"algorithm": {"kl_coef": -1}}, "algorithm.kl_coef"),
    ({"algorithm": {"loss_aggregation": "sum"}}, "algorithm.loss_aggregation"),
    ({"algorithm": {"correction_threshold": 0.5}}, "algorithm.correction_threshold"),
    ({"algorithm": {"normalize_std": 1}}, "algorithm.normalize_std"),
]


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)


def test_error_message_shows_the_value():
    with pytest.raises(ValueError, match=r"trainer\.micro_batch_size must be an int >= 1, got 0"):
        TrainerConfig(micro_batch_size=0)


def test_strict_parity_needs_invariance():
    with pytest.raises(ValueError, match="parity 'strict' needs batch_invariant"):
        RunConfig(batch_invariant=False)
    assert RunConfig(batch_invariant=False, parity="report").parity == "report"


def test_batch_must_split_into_micro_batches_over_ranks_for_training():
    config = RunConfig(
        rollout=RolloutConfig(prompts_per_step=3, samples_per_prompt=2),
        trainer=TrainerConfig(micro_batch_size=4),
    )
    with pytest.raises(
        ValueError, match="multiple of trainer.micro_batch_size x trainer.num_ranks"
    ):
        config.gradient_accumulation_steps  # noqa: B018 - the property raises


def test_repository_configs_load():
    from pathlib import Path

    paths = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))
    assert "demo.yaml" in [p.name for p in paths], f"configs/demo.yaml not among {paths}"
    for path in paths:
        RunConfig.from_yaml(path)


def test_sections_are_keyword_only_and_typed():
    with pytest.raises(TypeError):
        AlgorithmConfig("grpo")  # kw_only
    with pytest.raises(ValueError, match="rollout must be a RolloutConfig"):
        RunConfig(rollout={"max_new_tokens": 4})


def test_greedy_temperature_is_accepted():
    assert RunConfig.from_dict({"rollout": {"temperature": 0}}).rollout.temperature == 0


@pytest.mark.parametrize("text", ["off", "false", "'off'"])
def test_parity_off_spellings_in_yaml(tmp_path, text):
    """YAML 1.1 reads an unquoted `off` as false; every spelling means parity 'off'."""
    path = tmp_path / "run.yaml"
    path.write_text(f"batch_invariant: false\nparity: {text}\n")
    assert RunConfig.from_yaml(path).parity == "off"
    with pytest.raises(ValueError, match="parity must be one of"):
        RunConfig(parity=True)


def test_zero3_gets_host_memory_defaults_and_the_users_values_win():
    from rl_engine.executors.worker.ds_config import ZERO3_MEMORY_DEFAULTS, build_deepspeed_config

    plain = RunConfig.from_dict({"trainer": {"zero_stage": 3}})
    zero = build_deepspeed_config(plain, 1)["zero_optimization"]
    assert all(zero[k] == v for k, v in ZERO3_MEMORY_DEFAULTS.items())
    mine = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 123}}
    own = RunConfig.from_dict({"trainer": {"deepspeed": mine}})
    assert build_deepspeed_config(own, 1)["zero_optimization"]["reduce_bucket_size"] == 123
    stage2 = RunConfig.from_dict({"trainer": {"zero_stage": 2}})
    assert not set(ZERO3_MEMORY_DEFAULTS) & set(
        build_deepspeed_config(stage2, 1)["zero_optimization"]
    )


# ----------------------------------------------------------------------------- the sampling keys


def test_rollout_section_and_sampling_params_share_one_set_of_sampling_keys():
    """SamplingKeys is the one place: same names and defaults in the `rollout:` section and in
    SamplingParams, and from_config carries every one of them."""
    keys = {f.name: f.default for f in dataclasses.fields(SamplingKeys)}
    assert set(keys) >= {"max_new_tokens", "temperature", "top_p", "top_k"}
    for cls in (RolloutConfig, SamplingParams):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert {k: defaults[k] for k in keys} == keys, cls.__name__
    assert RolloutConfig().max_new_tokens == SamplingParams().max_new_tokens == 16
    rollout = RolloutConfig(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3)
    params = SamplingParams.from_config(rollout, seed=1)
    assert {k: getattr(params, k) for k in keys} == {k: getattr(rollout, k) for k in keys}
    assert RunConfig.from_dict({"rollout": {"top_k": 3}}).rollout.top_k == 3


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_new_tokens", 0), ("temperature", -0.5), ("top_p", 1.5), ("top_k", -1)],
)
def test_a_bad_sampling_key_fails_alike_in_the_config_and_in_sampling_params(key, value):
    with pytest.raises(ValueError) as config_error:
        RolloutConfig(**{key: value})
    with pytest.raises(ValueError) as params_error:
        SamplingParams(**{key: value})
    assert str(config_error.value) == f"rollout.{params_error.value}"
    assert str(params_error.value).startswith(f"{key} must be")


# ----------------------------------------------------------------------------- the config's layer

PACKAGE = Path(rl_engine.__file__).parent
ABOVE_CONFIG = (
    "rl_engine.executors",
    "rl_engine.diagnostics",
    "rl_engine.benchmarks",
    "rl_engine.cli",
    "ray",
    "deepspeed",
)
BELOW_CONFIG = ("rollout", "algorithms", "kernels", "patching", "models", "data", "rewards")


def test_the_config_imports_only_downward():
    """rl_engine/config/ sits above rollout/ and algorithms/ (it imports the sampling keys and
    the estimator names) and below executors/, diagnostics/, benchmarks/ and cli.py."""
    files = sorted((PACKAGE / "config").rglob("*.py"))
    assert any(f.name == "run.py" for f in files)
    offenders = [hit for path in files for hit in forbidden_imports(path, ABOVE_CONFIG)]
    assert not offenders, "rl_engine/config imports a layer above it:\n" + "\n".join(offenders)


def test_nothing_below_the_config_imports_it():
    """The layers the config imports never import it back (rl_engine.base.fields is plain Python)."""
    files = [p for name in BELOW_CONFIG for p in sorted((PACKAGE / name).rglob("*.py"))]
    files += [PACKAGE / "fields.py", PACKAGE / "io.py", PACKAGE / "devices.py"]
    assert all(f.is_file() for f in files) and len(files) > len(BELOW_CONFIG)
    offenders = [hit for path in files for hit in forbidden_imports(path, ("rl_engine.config",))]
    offenders += forbidden_imports(PACKAGE / "fields.py", ("rl_engine",))
    assert not offenders, "a layer below the config imports it:\n" + "\n".join(offenders)
