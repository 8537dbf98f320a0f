"""The environment keys: rollout.env and the episode limits, algorithm.turn_reward, and the
cross-section rules (the environment rewards and generates: nothing else may), each error
naming its key."""

from __future__ import annotations

import pytest

from rl_engine.config import RunConfig

ENV = "rl_engine.envs.calculator:Calculator"


def config(**sections) -> RunConfig:
    rollout = sections.pop("rollout", {})
    return RunConfig.from_dict({"rollout": {"env": ENV, **rollout}, **sections})


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


def test_turn_reward_is_sum_or_last():
    assert config(algorithm={"turn_reward": "last"}).algorithm.turn_reward == "last"
    with pytest.raises(ValueError, match=r"algorithm.turn_reward must be one of \['sum', 'last'\]"):
        config(algorithm={"turn_reward": "mean"})


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"reward": {"function": "math"}}, "reward.function cannot be set with rollout.env"),
        ({"rollout": {"source": "r.jsonl"}}, "rollout.source cannot be set with rollout.env"),
        (
            {"algorithm": {"overlong_penalty": {"buffer": 2, "factor": 1.0}}},
            "algorithm.overlong_penalty cannot be set with rollout.env",
        ),
        ({"rollout": {"task": "my.rewards:score"}}, "rollout.task 'my.rewards:score'"),
        (
            {"rollout": {"max_total_tokens": 16, "max_new_tokens": 16}},
            "rollout.max_total_tokens = 16 must be more than rollout.max_new_tokens = 16",
        ),
    ],
)
def test_what_an_environment_replaces_cannot_be_set_beside_it(sections, message):
    with pytest.raises(ValueError, match=message):
        config(**sections)


def test_prompts_still_come_from_a_task_or_a_dataset():
    assert config(rollout={"task": "arithmetic"}).rollout.task == "arithmetic"
    assert config(rollout={"task": "jsonl:q.jsonl"}).rollout.task == "jsonl:q.jsonl"
    assert config(data={"train_files": "q.jsonl"}).data.train_files == ["q.jsonl"]


def test_the_token_budget_holds_a_whole_episode():
    ok = config(rollout={"max_total_tokens": 96}, trainer={"max_tokens_per_micro_batch": 96})
    assert ok.trainer.max_tokens_per_micro_batch == 96
    with pytest.raises(
        ValueError,
        match="trainer.max_tokens_per_micro_batch = 95 is less than rollout.max_total_tokens = 96",
    ):
        config(rollout={"max_total_tokens": 96}, trainer={"max_tokens_per_micro_batch": 95})
    # without an environment the rule is the single completion's, as before
    plain = RunConfig.from_dict({"trainer": {"max_tokens_per_micro_batch": 17}})
    assert plain.trainer.max_tokens_per_micro_batch == 17
