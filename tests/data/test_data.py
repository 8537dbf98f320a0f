"""Prompt datasets through rl_engine.data's entry points (`check_dataset`, `load_dataset`):
verl-layout parquet written with HF datasets read as it is, several files and JSON lines with
renamed columns, and the tokenized dataset under the `data:` section's settings. The parts:
test_files.py (reading), test_records.py (columns), test_tokenize.py (chat template, prompt
length), test_stream.py (the seeded per-epoch stream)."""

from __future__ import annotations

import json

from rl_engine.config import DataConfig
from rl_engine.data import check_dataset, load_dataset
from rl_engine.data.tokenize import tokenize_records
from tests.helpers.chat_model import build_tokenizer
from tests.helpers.data import verl_rows, write_parquet


def test_verl_parquet_is_read_as_it_is(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(5))
    records = check_dataset([path], DataConfig(), key="data.train_files")
    assert len(records) == 5
    first = records[0]
    assert first.messages == [{"role": "user", "content": "what is 0 plus 1 ?"}]
    assert first.ground_truth == "1" and first.data_source == "toy/add"
    assert first.extra_info == {"split": "train", "index": 0}
    assert (first.file, first.row) == (path, 0)


def test_several_files_plain_text_prompts_and_renamed_columns(tmp_path):
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(
        json.dumps({"question": "what is 3 plus 4 ?", "solution": {"value": 7}}) + "\n\n"
        + json.dumps({"question": "what is 1 plus 1 ?", "solution": {"value": 2}}) + "\n"
    )  # fmt: skip
    data = DataConfig(prompt_key="question", answer_key="solution.value")
    records = check_dataset([str(jsonl)], data, key="data.train_files")
    assert [r.messages[0]["content"] for r in records] == [
        "what is 3 plus 4 ?",
        "what is 1 plus 1 ?",
    ]
    assert [r.ground_truth for r in records] == [7, 2]
    assert records[0].data_source == "extra" and records[0].extra_info is None  # file stem
    both = check_dataset(
        [write_parquet(tmp_path / "a.parquet", verl_rows(2)), str(tmp_path / "a.parquet")],
        DataConfig(),
        key="data.train_files",
    )
    assert len(both) == 4


def test_load_dataset_is_check_dataset_tokenized_under_the_data_section(tmp_path):
    tok = build_tokenizer()
    path = write_parquet(tmp_path / "t.parquet", verl_rows(3))
    data = DataConfig(system_prompt="be brief", max_prompt_length=64, truncation="right")
    dataset = load_dataset([path], data, tok, key="data.val_files")
    records = check_dataset([path], data, key="data.val_files")
    assert [r.messages for r in dataset.records] == [r.messages for r in records]
    assert all(r.prompt_ids for r in dataset.records) and not any(r.prompt_ids for r in records)
    expected = tokenize_records(
        records, tok, system_prompt="be brief", max_prompt_length=64, truncation="right", key="k"
    )
    assert [r.prompt_ids for r in dataset.records] == [r.prompt_ids for r in expected.records]
