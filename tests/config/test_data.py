"""The `data:` section (rl_engine/config/data.py): prompt files as one path or a list (kept as a
list), the columns and the prompt-length policy, and one ValueError per invalid key naming it."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import TRUNCATIONS, DataConfig, RunConfig

INVALID = [
    ({"data": {"train_files": []}}, "data.train_files"),
    ({"data": {"val_files": ["a.jsonl", ""]}}, "data.val_files"),
    ({"data": {"truncation": "middle"}}, "data.truncation"),
    ({"data": {"max_prompt_length": 0}}, "data.max_prompt_length"),
    ({"data": {"prompt_key": ""}}, "data.prompt_key"),
    ({"data": {"answer_key": ""}}, "data.answer_key"),
    ({"data": {"system_prompt": ""}}, "data.system_prompt"),
    ({"data": {"shuffle": "no"}}, "data.shuffle"),
]


def test_one_path_becomes_a_list_and_the_defaults_are_verls():
    config = RunConfig.from_dict({"data": {"train_files": "a.parquet"}})
    assert config.data.train_files == ["a.parquet"] and config.data.max_prompt_length == 1024
    d = DataConfig(val_files=["a.jsonl", "b.parquet"])
    assert d.train_files is None and d.val_files == ["a.jsonl", "b.parquet"]
    assert (d.prompt_key, d.answer_key, d.truncation) == (
        "prompt",
        "reward_model.ground_truth",
        "filter",
    )
    assert set(TRUNCATIONS) == {"filter", "left", "right", "error"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"train_files": []}, "data.train_files must be a path or a non-empty list"),
        ({"truncation": "middle"}, "data.truncation must be one of"),
        ({"max_prompt_length": 0}, "data.max_prompt_length must be an int >= 1"),
    ],
)
def test_bad_keys_name_their_bound(data, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"data": data})


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)
