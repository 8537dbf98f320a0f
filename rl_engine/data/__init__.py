"""Prompt datasets: verl-layout parquet / JSON-lines files -> tokenized prompts -> a seeded stream.

- `check_dataset(files, data)`: the files exist, are readable, have the configured
  columns and at least one row; no tokenizer needed (the job's preflight, before Ray).
- `load_dataset(files, data, tokenizer)`: rows -> chat template -> token ids, with
  `data.max_prompt_length` enforced (`PromptDataset`).
- `PromptStream(dataset, seed=...)`: position -> prompt, one seeded shuffle per epoch.
"""

from __future__ import annotations

from rl_engine.data.files import DataFileError, read_rows
from rl_engine.data.records import PromptRecord, read_records
from rl_engine.data.stream import PromptStream
from rl_engine.data.tokenize import PromptDataset, encode_messages, tokenize_records

__all__ = [
    "DataFileError",
    "PromptDataset",
    "PromptRecord",
    "PromptStream",
    "check_dataset",
    "encode_messages",
    "load_dataset",
    "read_rows",
]


def check_dataset(files: list[str], data, *, key: str) -> list[PromptRecord]:
    """The records of `files` (untokenized); DataFileError naming the file and column if unusable."""
    return read_records(files, prompt_key=data.prompt_key, answer_key=data.answer_key, key=key)


def load_dataset(files: list[str], data, tokenizer, *, key: str) -> PromptDataset:
    """`files` read and tokenized under the `data` config section (DataConfig)."""
    records = check_dataset(files, data, key=key)
    return tokenize_records(
        records,
        tokenizer,
        system_prompt=data.system_prompt,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        key=key,
    )
