"""Rows of a prompt file -> `PromptRecord`s, in verl's layout or with renamed columns.

verl's layout (one row per prompt):

| column | what | used as |
|---|---|---|
| `prompt` (`data.prompt_key`) | a list of chat messages `{role, content}`, or plain text | the prompt, through the chat template |
| `reward_model.ground_truth` (`data.answer_key`) | the reference answer (any JSON value) | `ground_truth` of the reward |
| `data_source` | the dataset's name (e.g. `openai/gsm8k`) | `data_source` of the reward; eval groups by it |
| `extra_info` | anything (a dict in verl) | `extra_info` of the reward |

`data_source` and `extra_info` are optional (missing: the file's stem, None). Errors name
the config key, the file, the column and, for a bad value, the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_engine.data.files import DataFileError, column_names, read_rows

DATA_SOURCE = "data_source"
EXTRA_INFO = "extra_info"


@dataclass(slots=True)
class PromptRecord:
    """One prompt and what its reward needs; `prompt_ids` are set once it is tokenized."""

    messages: list[dict]
    """Chat messages ({'role', 'content'}) in order."""
    ground_truth: Any
    data_source: str
    extra_info: Any = None
    file: str = ""
    row: int = 0
    """Row number in its file (0-based)."""
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def where(self) -> str:
        """'<file> row <n>' for a record read from a file; '' for one made in code (a task's)."""
        return f"{self.file} row {self.row}" if self.file else ""


def read_records(
    files: list[str], *, prompt_key: str, answer_key: str, key: str
) -> list[PromptRecord]:
    """Every row of `files` as a PromptRecord, in file order; the files' columns are checked first."""
    for path in files:
        check_columns(path, prompt_key=prompt_key, answer_key=answer_key, key=key)
    records = []
    for path in files:
        rows = read_rows(path, key=key)
        stem = Path(path).stem
        for number, row in enumerate(rows):
            records.append(_record(row, number, str(path), stem, prompt_key, answer_key))
    if not records:
        raise DataFileError(f"{key}: {', '.join(map(str, files))} holds no rows (an empty dataset)")
    return records


def check_columns(path: str, *, prompt_key: str, answer_key: str, key: str) -> None:
    """The prompt column and the answer's top-level column exist in `path`, else DataFileError."""
    names = column_names(path, key=key)
    for setting, column in (("data.prompt_key", prompt_key), ("data.answer_key", answer_key)):
        top = column.split(".")[0]
        if top not in names:
            raise DataFileError(
                f"{key}: {path} has no column {top!r} ({setting}: {column!r}); its columns: "
                f"{', '.join(names) or 'none (empty file)'}"
            )


def _record(row: dict, number: int, path: str, stem: str, prompt_key: str, answer_key: str):
    where = f"{path} row {number}"
    messages = _messages(row.get(prompt_key), where, prompt_key)
    truth = _field(row, answer_key, where)
    source = row.get(DATA_SOURCE)
    return PromptRecord(
        messages=messages,
        ground_truth=truth,
        data_source=source if isinstance(source, str) and source else stem,
        extra_info=row.get(EXTRA_INFO),
        file=path,
        row=number,
    )


def _messages(value, where: str, column: str) -> list[dict]:
    """Plain text -> one user turn; a list of {role, content} -> those turns."""
    if isinstance(value, str):
        if not value:
            raise DataFileError(f"{where}: column {column!r} is an empty string")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise DataFileError(
            f"{where}: column {column!r} must be text or a non-empty list of chat messages "
            f"{{role, content}}, got {value!r:.100}"
        )
    messages = []
    for turn in value:
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("role"), str)
            and isinstance(turn.get("content"), str)
        ):
            raise DataFileError(
                f"{where}: column {column!r} holds a message that is not {{role: str, content: "
                f"str}}: {turn!r:.100}"
            )
        messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


def _field(row: dict, dotted: str, where: str):
    """`row['a']['b']` for 'a.b'; a missing or null field names the column."""
    value: Any = row
    walked = []
    for part in dotted.split("."):
        walked.append(part)
        if not isinstance(value, dict) or part not in value:
            raise DataFileError(
                f"{where}: no field {'.'.join(walked)!r} (data.answer_key: {dotted!r})"
            )
        value = value[part]
    if value is None:
        raise DataFileError(f"{where}: {dotted!r} is null (data.answer_key)")
    return value
