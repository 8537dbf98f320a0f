"""Atomic file writes: a report or checkpoint is either complete or absent, never half-written."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FILE_MODE = 0o644
"""Output files are group- and world-readable (mkstemp alone would make them 0600)."""


def write_text_atomic(path: str | Path, text: str) -> Path:
    return _write_atomic(path, text, "w")


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    return _write_atomic(path, data, "wb")


def _write_atomic(path: str | Path, content: str | bytes, mode: str) -> Path:
    """Write a temporary file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, payload) -> Path:
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
