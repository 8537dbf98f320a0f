"""Atomic writes: a file is complete or absent, never half-written."""

import os
import stat

import pytest

from rl_engine.base.io import write_json_atomic, write_text_atomic


def test_atomic_writes_replace_whole_files_and_leave_no_temporaries(tmp_path):
    path = write_json_atomic(tmp_path / "r" / "report.json", {"a": 1})
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"
    assert sorted(os.listdir(path.parent)) == ["report.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """The payload fails to serialise mid-write: the previous report stays whole."""
    path = write_json_atomic(tmp_path / "report.json", {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert path.read_text() == write_json_atomic(tmp_path / "copy.json", {"a": 1}).read_text()
    assert sorted(os.listdir(tmp_path)) == ["copy.json", "report.json"]
