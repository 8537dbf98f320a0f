"""The `checkpoint:` section (rl_engine/config/checkpoint.py): its defaults (only after the last
step, two kept, with the optimizer state) and one ValueError per invalid key naming it."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import CheckpointConfig, RunConfig

INVALID = [
    ({"checkpoint": {"every": -1}}, "checkpoint.every"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
    ({"checkpoint": {"weights_only": "no"}}, "checkpoint.weights_only"),
]


def test_defaults():
    c = CheckpointConfig()
    assert (c.every, c.keep_last, c.weights_only) == (0, 2, False)
    assert RunConfig.from_dict({"checkpoint": {"every": 5}}).checkpoint.every == 5


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)
