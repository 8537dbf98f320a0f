"""The `reward:` section (rl_engine/config/reward.py): its defaults (the function by
data_source, scored in the driver, a failing score counted as 0) and one ValueError per
invalid key naming it."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import REWARD_ERRORS, RewardConfig, RunConfig

INVALID = [
    ({"reward": {"num_workers": -1}}, "reward.num_workers"),
    ({"reward": {"on_error": "skip"}}, "reward.on_error"),
    ({"reward": {"function": ""}}, "reward.function"),
    ({"reward": {"kwargs": [1]}}, "reward.kwargs"),
    ({"reward": {"kwargs": {1: "a"}}}, "reward.kwargs"),
    ({"reward": {"timeout_s": 0}}, "reward.timeout_s"),
]


def test_defaults():
    r = RewardConfig()
    assert (r.function, r.kwargs, r.num_workers, r.timeout_s, r.on_error) == (
        None,
        {},
        0,
        10.0,
        "zero",
    )
    assert set(REWARD_ERRORS) == {"zero", "fail"}
    assert RewardConfig(function="gsm8k", kwargs={"scale": 2}).kwargs == {"scale": 2}


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"num_workers": -1}, "reward.num_workers must be an int >= 0"),
        ({"on_error": "skip"}, "reward.on_error must be one of"),
    ],
)
def test_bad_keys_name_their_bound(reward, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"reward": reward})


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)
