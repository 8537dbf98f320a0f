"""The job's environment runner, without engines: it loads `rollout.env`'s class (a bad name is
an error naming rollout.env and the missing class), builds each environment with
`rollout.env_args`, takes its limits from the config, and hands `reset` the record's prompt
ids, last user turn, answer and extra_info."""

from __future__ import annotations

import pytest

from rl_engine.config import RunConfig
from rl_engine.data import PromptRecord
from rl_engine.envs.guess_number import GuessNumber
from rl_engine.executors.job.episodes import EpisodeRunner

ENV = "rl_engine.envs.guess_number:GuessNumber"


def test_runner_builds_the_configured_environment_with_its_args_and_limits():
    config = RunConfig.from_dict(
        {
            "rollout": {
                "env": ENV,
                "env_args": {"low": 5, "high": 9, "penalty": 0.25},
                "max_turns": 2,
            }
        }
    )
    runner = EpisodeRunner(config, tokenizer=None, vocab_size=64)
    assert runner.env_class is GuessNumber and not runner.tensor_parallel
    assert runner.limits.max_turns == 2
    first, second = runner.make_env(), runner.make_env()
    assert first is not second  # one environment per episode
    assert (first.low, first.high, first.penalty) == (5, 9, 0.25)


def test_a_missing_environment_class_names_the_key_and_the_class():
    config = RunConfig.from_dict({"rollout": {"env": "rl_engine.envs.guess_number:Nope"}})
    with pytest.raises(ValueError, match=r"rollout.env '.*:Nope': .* has no class 'Nope'"):
        EpisodeRunner(config, tokenizer=None, vocab_size=64)


def test_reset_gets_the_last_user_turn_and_the_answer():
    record = PromptRecord(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "guess 1..9"},
        ],
        ground_truth="7",
        data_source="games",
        extra_info={"level": 1},
        prompt_ids=[3, 4],
    )
    assert EpisodeRunner.reset_record(record) == {
        "prompt_ids": [3, 4],
        "prompt": "guess 1..9",
        "answer": "7",
        "extra_info": {"level": 1},
    }
    bare = PromptRecord(messages=[], ground_truth=None, data_source="count", prompt_ids=[9])
    assert EpisodeRunner.reset_record(bare)["prompt"] is None
