"""The `logging:` section (rl_engine/config/logging.py): the trackers as a non-empty list of
known backends, each once, 'jsonl' always among them (resume reads metrics.jsonl); one backend
may be given as a string; each error names the key."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import BACKENDS, LoggingConfig, RunConfig

INVALID = [
    ({"logging": {"backends": []}}, "logging.backends"),
    ({"logging": {"backends": ["jsonl", "jsonl"]}}, "logging.backends"),
    ({"logging": {"project": ""}}, "logging.project"),
    ({"logging": {"experiment_name": ""}}, "logging.experiment_name"),
]


def test_defaults_and_a_single_backend_as_a_string():
    c = LoggingConfig()
    assert (c.backends, c.project, c.experiment_name) == (["jsonl"], "rl_engine", None)
    assert LoggingConfig(backends="jsonl").backends == ["jsonl"]
    assert LoggingConfig(backends=list(BACKENDS)).backends == list(BACKENDS)


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        (["jsonl", "comet"], "logging.backends must be one of"),
        (["tensorboard"], "that includes 'jsonl'"),
        (["jsonl", "wandb", "wandb"], "a list without repeats"),
    ],
)
def test_bad_backends_name_the_key(backends, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"logging": {"backends": backends}})


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)
