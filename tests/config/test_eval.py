"""The `eval:` section (rl_engine/config/eval.py): its defaults (greedy, one sample, at step 0
and the end) and one ValueError per invalid key naming it; eval.every needs validation prompts
(tests/config/test_cross_checks.py)."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import EvalConfig, RunConfig

INVALID = [
    ({"eval": {"samples_per_prompt": 0}}, "eval.samples_per_prompt"),
    ({"eval": {"every": -1}}, "eval.every"),
    ({"eval": {"temperature": -1.0}}, "eval.temperature"),
    ({"eval": {"max_new_tokens": 0}}, "eval.max_new_tokens"),
    ({"eval": {"before_train": "yes"}}, "eval.before_train"),
]


def test_defaults():
    e = EvalConfig()
    assert (e.every, e.samples_per_prompt, e.temperature, e.max_new_tokens) == (0, 1, 0.0, None)
    assert e.before_train is True and EvalConfig(max_new_tokens=8).max_new_tokens == 8


def test_samples_per_prompt_names_its_bound():
    with pytest.raises(ValueError, match="eval.samples_per_prompt must be an int >= 1"):
        RunConfig.from_dict({"eval": {"samples_per_prompt": 0}})


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)
