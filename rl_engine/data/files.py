"""Reading prompt files: parquet (verl's format), JSON lines, or a JSON array of rows.

Every failure names the file (and for JSON the line): a user sees which of their
files is wrong before Ray starts.
"""

from __future__ import annotations

import json
from pathlib import Path

SUFFIXES = (".parquet", ".jsonl", ".json")


class DataFileError(ValueError):
    """A prompt file cannot be read or lacks what the config asks for (exit code 2)."""


def read_rows(path: str | Path, *, key: str = "data.train_files") -> list[dict]:
    """The rows of one prompt file as dicts (parquet via pyarrow, JSON lines line by line)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataFileError(f"{key}: file {str(file)!r} does not exist")
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(file, key)
    if suffix in (".jsonl", ".json"):
        return _read_json(file, key)
    raise DataFileError(
        f"{key}: {str(file)!r} is neither parquet nor JSON lines (expected a name ending in "
        f"{', '.join(SUFFIXES)})"
    )


def column_names(path: str | Path, *, key: str = "data.train_files") -> list[str]:
    """Top-level column names of a prompt file (parquet: from its schema, without reading rows)."""
    file = Path(path).expanduser()
    if file.suffix.lower() == ".parquet" and file.is_file():
        pq = _pyarrow_parquet(key)
        try:
            return list(pq.read_schema(file).names)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError for a damaged file
            raise DataFileError(
                f"{key}: {str(file)!r} is not a readable parquet file ({err})"
            ) from None
    rows = read_rows(file, key=key)
    return sorted({name for row in rows for name in row})


def _pyarrow_parquet(key: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataFileError(
            f"{key}: reading parquet needs pyarrow: pip install 'rl-engine[data]'"
        ) from None
    return pq


def _read_parquet(file: Path, key: str) -> list[dict]:
    pq = _pyarrow_parquet(key)
    try:
        table = pq.read_table(file)
    except Exception as err:  # ArrowInvalid, OSError: not parquet, truncated, ...
        raise DataFileError(
            f"{key}: {str(file)!r} is not a readable parquet file ({err})"
        ) from None
    return table.to_pylist()


def _read_json(file: Path, key: str) -> list[dict]:
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataFileError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from None
        for number, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataFileError(f"{file}: element {number} is not an object: {row!r:.80}")
        return rows
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFileError(f"{file}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataFileError(f"{file}:{number}: expected a JSON object, got {line.strip()[:80]}")
        rows.append(row)
    return rows
