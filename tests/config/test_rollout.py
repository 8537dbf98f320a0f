"""The `rollout:` section (rl_engine/config/rollout.py): one ValueError per invalid key naming
it; the sampling keys are SamplingParams' own (same names, defaults and errors); the
environment's keys (rollout.env and the episode limits) with their defaults, their errors, and
their refusal without an environment; the section is frozen, as its sampling keys are."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rl_engine.config import RolloutConfig, RunConfig
from rl_engine.config.rollout import ENV_KEYS, PLACEMENTS
from rl_engine.rollout.sampling import SamplingKeys, SamplingParams

ENV = "rl_engine.envs.calculator:Calculator"

INVALID = [
    ({"rollout": {"num_engines": 0}}, "rollout.num_engines"),
    ({"rollout": {"max_batch_size": 0}}, "rollout.max_batch_size"),
    ({"rollout": {"prompts_per_step": 0}}, "rollout.prompts_per_step"),
    ({"rollout": {"samples_per_prompt": 0}}, "rollout.samples_per_prompt"),
    ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens"),
    ({"rollout": {"temperature": -0.5}}, "rollout.temperature"),
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"rollout": {"top_k": -1}}, "rollout.top_k"),
    ({"rollout": {"task": ""}}, "rollout.task"),
    ({"rollout": {"placement": "pack_tight"}}, "rollout.placement"),
    ({"rollout": {"source": ""}}, "rollout.source"),
    ({"rollout": {"share_prompt_prefill": "yes"}}, "rollout.share_prompt_prefill"),
    ({"rollout": {"save": 1}}, "rollout.save"),
    ({"rollout": {"filter_groups": "no"}}, "rollout.filter_groups"),
    ({"rollout": {"tensor_parallel_size": 3}}, "rollout.tensor_parallel_size"),
    ({"rollout": {"filter_groups_max_tries": 0}}, "rollout.filter_groups_max_tries"),
    ({"rollout": {"max_staleness": -1}}, "rollout.max_staleness"),
    ({"rollout": {"max_staleness": 1.5}}, "rollout.max_staleness"),
    ({"rollout": {"async_order": "fifo"}}, "rollout.async_order"),
]


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)


def config(**sections) -> RunConfig:
    """A run with an environment (the calculator) and the given sections."""
    rollout = sections.pop("rollout", {})
    return RunConfig.from_dict({"rollout": {"env": ENV, **rollout}, **sections})


def test_greedy_temperature_is_accepted():
    assert RunConfig.from_dict({"rollout": {"temperature": 0}}).rollout.temperature == 0


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


def test_defaults_and_a_yaml_round_trip(tmp_path):
    c = config(rollout={"env_args": {"open_tag": "[["}, "stop_strings": ["</calc>"]})
    r = c.rollout
    assert (r.max_turns, r.max_total_tokens, r.env_timeout_s) == (4, 1024, 10.0)
    assert c.algorithm.turn_reward == "sum"
    c.to_yaml(tmp_path / "c.yaml")
    assert RunConfig.from_yaml(tmp_path / "c.yaml") == c
    assert RunConfig().rollout.env is None and RunConfig().rollout.stop_strings == []


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"env": ""}, "rollout.env must be a non-empty string"),
        ({"env_args": [1]}, "rollout.env_args must be a mapping"),
        ({"max_turns": 0}, "rollout.max_turns must be an int >= 1"),
        ({"max_total_tokens": 1}, "rollout.max_total_tokens must be an int >= 2"),
        ({"env_timeout_s": 0}, "rollout.env_timeout_s must be a finite number > 0"),
        ({"stop_strings": "</calc>"}, "rollout.stop_strings must be a list of non-empty strings"),
        ({"stop_strings": [""]}, "rollout.stop_strings must be a list of non-empty strings"),
    ],
)
def test_each_invalid_env_key_names_itself(rollout, message):
    with pytest.raises(ValueError, match=message):
        config(rollout=rollout)


@pytest.mark.parametrize(
    "key", ["env_args", "max_turns", "max_total_tokens", "env_timeout_s", "stop_strings"]
)
def test_episode_keys_without_an_environment_are_refused(key):
    value = {
        "env_args": {"a": 1},
        "max_turns": 2,
        "max_total_tokens": 64,
        "env_timeout_s": 1.0,
        "stop_strings": ["x"],
    }[key]
    with pytest.raises(ValueError, match=f"rollout.{key} is read only with rollout.env"):
        RunConfig.from_dict({"rollout": {key: value}})


def test_the_env_keys_are_the_fields_read_only_with_an_environment():
    names = {f.name for f in dataclasses.fields(RolloutConfig)}
    assert set(ENV_KEYS) <= names and ENV_KEYS[0] == "env"
    assert all(RolloutConfig(placement=p).placement == p for p in PLACEMENTS)


def test_the_section_is_frozen_as_its_sampling_keys_are():
    rollout = RolloutConfig(top_k=3)
    assert isinstance(rollout, SamplingKeys)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.top_k = 4  # type: ignore[misc]
