"""The benchmarks' timing and memory helpers (rl_engine/benchmarks/timing.py): interleaved
medians call each side once to warm up and then `reps` times, the intra-op thread count is
restored, the peak-RSS counter sees an allocation after a reset, and a benchmark child's
environment drops the parent's rendezvous."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from rl_engine.benchmarks.timing import (
    child_env,
    current_rss_bytes,
    interleaved_ratio,
    intra_op_threads,
    peak_extra_memory,
    peak_rss_bytes,
    reset_peak_rss,
)


def test_interleaved_ratio_alternates_the_two_sides():
    calls = []
    ours, plain = interleaved_ratio(lambda: calls.append("a"), lambda: calls.append("b"), reps=3)
    assert calls == ["a", "b"] * 4  # one warm-up each, then alternating
    assert ours >= 0 and plain >= 0


def test_the_thread_count_is_restored_even_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), intra_op_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == before


def test_the_peak_rss_counter_sees_an_allocation_after_a_reset():
    """A fresh anonymous mapping: heap memory could reuse pages a long-lived test process
    already holds resident, and then the peak would not move."""
    reset_peak_rss()
    before = current_rss_bytes()
    with mmap.mmap(-1, 32 << 20) as block:
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        assert peak_rss_bytes() - before >= 30 << 20


def test_a_childs_environment_has_no_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    env = child_env(EXTRA="1")
    assert "MASTER_PORT" not in env and "RANK" not in env
    assert (env["DS_ACCELERATOR"], env["EXTRA"]) == ("cpu", "1")


def test_a_failing_memory_probe_shows_its_stderr():
    with pytest.raises(RuntimeError, match=r"memory probe nope failed:[\s\S]*No module named"):
        peak_extra_memory("rl_engine.benchmarks.no_such_probe", "nope")
    assert sys.executable  # the probe runs under this interpreter
