"""The job benchmark's memory sampler (rl_engine/benchmarks/job_memory.py): it reads a process
session's memory, and its guard kills the job when free memory falls below the limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def _child(seconds: float) -> subprocess.Popen:
    """A process that holds 64 MB for `seconds`, in a session of its own (as the job runs)."""
    code = f"import time; x = bytearray(64 << 20); time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_bench_job_sampler_reads_a_process_and_its_guard_kills_it(tmp_path):
    from rl_engine.benchmarks.job_memory import GIB, Sampler

    proc = _child(2.0)
    sampler = Sampler(tmp_path, proc.pid, 0, lambda: os.killpg(proc.pid, signal.SIGKILL))
    assert proc.wait(timeout=60) == 0
    sampler.stop()
    assert not sampler.guard_tripped and sampler.baseline > 0
    assert sampler.peak_hwm["driver"] >= 64 << 20 and sampler.driver_rss
    assert sampler.peak_job_pss >= 64 << 20

    proc = _child(60.0)
    guard = 10**6 * GIB  # more than any machine has available: the guard trips at once
    sampler = Sampler(tmp_path, proc.pid, guard, lambda: os.killpg(proc.pid, signal.SIGKILL))
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        sampler.stop()
        if proc.poll() is None:
            proc.kill()
    assert sampler.guard_tripped
