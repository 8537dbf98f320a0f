"""Rows as prompt records (rl_engine/data/records.py): the prompt column as text or chat
messages, the answer by a dotted key into a struct column, data_source defaulting to the
file's stem; a missing column, field or malformed message is a DataFileError naming the
file, the row and the config key."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import DataConfig
from rl_engine.data import DataFileError, PromptRecord, check_dataset
from rl_engine.data.records import check_columns, read_records
from tests.helpers.data import verl_rows, write_parquet


def test_missing_columns_name_the_file_and_column(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in verl_rows(2)]
    path = write_parquet(tmp_path / "noanswer.parquet", rows)
    with pytest.raises(DataFileError, match=r"noanswer\.parquet has no column 'reward_model'"):
        check_dataset([path], DataConfig(), key="data.train_files")
    path = write_parquet(tmp_path / "t.parquet", verl_rows(2))
    with pytest.raises(DataFileError, match=r"has no column 'question' \(data\.prompt_key"):
        check_dataset([path], DataConfig(prompt_key="question"), key="data.val_files")
    with pytest.raises(DataFileError, match=r"row 0: no field 'reward_model.answer'"):
        check_dataset([path], DataConfig(answer_key="reward_model.answer"), key="k")
    bad = verl_rows(2)
    bad[1]["prompt"] = [{"role": "user"}]
    with pytest.raises(DataFileError, match=r"row 1: column 'prompt' holds a message"):
        check_dataset([write_parquet(tmp_path / "m.parquet", bad)], DataConfig(), key="k")


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_text_prompts_become_one_user_turn_and_the_stem_is_the_source(tmp_path):
    path = jsonl(tmp_path / "mine.jsonl", [{"q": "hi", "a": {"b": 0}, "data_source": ""}])
    (record,) = read_records([path], prompt_key="q", answer_key="a.b", key="k")
    assert record.messages == [{"role": "user", "content": "hi"}]
    assert (record.ground_truth, record.data_source, record.where) == (0, "mine", f"{path} row 0")
    assert isinstance(record, PromptRecord) and record.prompt_ids == []


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"q": "", "a": 1}, r"row 0: column 'q' is an empty string"),
        ({"q": [], "a": 1}, r"row 0: column 'q' must be text or a non-empty list of chat messages"),
        ({"q": "x", "a": None}, r"row 0: 'a' is null \(data\.answer_key\)"),
    ],
)
def test_a_bad_row_names_its_file_and_number(tmp_path, row, message):
    path = jsonl(tmp_path / "r.jsonl", [row])
    with pytest.raises(DataFileError, match=message):
        read_records([path], prompt_key="q", answer_key="a", key="k")


def test_columns_are_checked_before_any_row_is_read(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", verl_rows(1))
    bad = jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}])
    check_columns(good, prompt_key="prompt", answer_key="reward_model.ground_truth", key="k")
    with pytest.raises(
        DataFileError, match=r"^k: .*bad\.jsonl has no column 'reward_model' .* its columns: prompt"
    ):
        read_records(
            [good, bad], prompt_key="prompt", answer_key="reward_model.ground_truth", key="k"
        )


def test_an_empty_json_lines_file_has_no_columns(tmp_path):
    """JSON lines carry their columns in their rows: an empty file fails the column check,
    saying so (an empty parquet keeps its schema and fails as empty: test_files.py)."""
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(
        DataFileError, match=r"e\.jsonl has no column 'prompt' .*none \(empty file\)"
    ):
        check_dataset([str(tmp_path / "e.jsonl")], DataConfig(), key="data.train_files")
