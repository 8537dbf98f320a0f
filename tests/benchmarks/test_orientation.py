"""The llama.cpp orientation row (rl_engine/benchmarks/orientation.py): without llama-cpp-python
the row is one line saying it is skipped (with it, a rate; not run here: the dev extra)."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import orientation


def test_without_llama_cpp_the_row_says_it_is_skipped(monkeypatch):
    monkeypatch.setattr(orientation, "llama_cpp_installed", lambda: False)
    assert orientation.orientation_line([1, 2, 3], 4, 1) == orientation.SKIPPED
    assert "llama-cpp-python is not installed" in orientation.SKIPPED


def test_the_installed_check_matches_the_import():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert not orientation.llama_cpp_installed()
    else:
        pytest.skip("llama-cpp-python is installed here")
