"""Reading one prompt file (rl_engine/data/files.py): parquet through pyarrow, JSON lines line by
line (blank lines skipped), a .json array of objects; the column names without reading a
parquet's rows; every unreadable file is a DataFileError naming the file (and the line)."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import DataConfig
from rl_engine.data import DataFileError, check_dataset, read_rows
from rl_engine.data.files import column_names
from tests.helpers.data import verl_rows, write_parquet


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: str(d / "missing.parquet"), r"missing\.parquet' does not exist"),
        (lambda d: _write(d / "bad.parquet", b"not parquet"), r"bad\.parquet' is not a readable parquet"),
        (lambda d: _write(d / "x.csv", b"a,b"), "neither parquet nor JSON lines"),
        (lambda d: _empty_parquet(d / "empty.parquet"), r"empty\.parquet holds no rows"),
        (lambda d: _write(d / "bad.jsonl", b'{"prompt": "x"}\n{oops\n'), r"bad\.jsonl:2: not valid JSON"),
    ],
)  # fmt: skip
def test_bad_files_name_the_file(tmp_path, make, message):
    with pytest.raises(DataFileError, match=message):
        check_dataset([make(tmp_path)], DataConfig(), key="data.train_files")


def _empty_parquet(path) -> str:
    """verl's columns, no rows."""
    import datasets

    datasets.Dataset.from_list(verl_rows(2)).select([]).to_parquet(str(path))
    return str(path)


def _write(path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


def test_parquet_rows_come_back_as_written_with_the_schemas_columns(tmp_path):
    rows = verl_rows(3)
    path = write_parquet(tmp_path / "t.parquet", rows)
    assert read_rows(path) == rows
    assert sorted(column_names(path)) == sorted(rows[0])


def test_json_lines_and_a_json_array(tmp_path):
    rows = [{"prompt": "a", "n": 1}, {"prompt": "b", "m": None}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "r.json").write_text(json.dumps(rows))
    assert read_rows(tmp_path / "r.jsonl") == read_rows(tmp_path / "r.json") == rows
    assert column_names(tmp_path / "r.jsonl") == ["m", "n", "prompt"]  # every row's, sorted


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.json", '[{"p": 1}, 3]', r"a\.json: element 1 is not an object: 3"),
        ("b.json", '[{"p": 1},', r"b\.json:1: not valid JSON"),
        ("c.jsonl", '{"p": 1}\n[1, 2]\n', r"c\.jsonl:2: expected a JSON object, got \[1, 2\]"),
    ],
)
def test_bad_json_names_the_file_and_where(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataFileError, match=message):
        read_rows(tmp_path / name)


def test_errors_name_the_config_key_they_came_from(tmp_path):
    with pytest.raises(
        DataFileError, match=r"^data\.val_files: file '.*nope\.jsonl' does not exist"
    ):
        read_rows(tmp_path / "nope.jsonl", key="data.val_files")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataFileError, match=r"^eval: '.*bad\.parquet' is not a readable parquet"):
        column_names(tmp_path / "bad.parquet", key="eval")
