"""Timing and peak-memory helpers shared by the benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch


def interleaved_ratio(ours: Callable, plain: Callable, *, reps: int = 5) -> tuple[float, float]:
    """(t_ours, t_plain): medians of alternating runs, so machine noise hits both alike."""
    ours(), plain()
    t_ours, t_plain = [], []
    for _ in range(reps):
        for fn, sink in ((ours, t_ours), (plain, t_plain)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(t_ours), statistics.median(t_plain)


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count is `n` inside, and what it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> None:
    """Make the peak-RSS counter (VmHWM) restart from the current RSS (Linux >= 4.0).

    `ru_maxrss` cannot be used: it survives fork + exec, so a child started by a
    process holding gigabytes reports the parent's peak.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """VmHWM: this address space's peak RSS since start or the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


# A parent's rendezvous (a test process that ran a DeepSpeed world, a torchrun shell) must not
# leak into a single-process benchmark child: its MASTER_PORT may still be bound.
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark child: this one, on DeepSpeed's CPU accelerator, without
    the distributed rendezvous variables (the child's worker picks a free port of its own)."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    return {**env, "DS_ACCELERATOR": "cpu", **extra}


def peak_extra_memory(module: str, case: str, *args: str) -> int:
    """Run `python -m <module> <case> ...` in a fresh process; it prints {"peak_extra": bytes}.

    One case per process: freed memory that the allocator keeps would hide the
    next case's peak.
    """
    proc = subprocess.run(
        [sys.executable, "-m", module, case, *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {case} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra"]


def peak_extra_memories(module: str, cases: tuple[str, ...], *args: str) -> dict[str, int]:
    """Run `python -m <module> <case,case,...> ...` in ONE fresh process; it measures the cases
    in order, printing a {"peak_extra": bytes} line each. For smoke runs (`--tiny`) only: memory
    an earlier case freed but the allocator kept can lower a later case's figure."""
    joined = ",".join(cases)
    proc = subprocess.run(
        [sys.executable, "-m", module, joined, *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probes {joined} failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.strip().splitlines()[-len(cases) :]
    return {case: json.loads(line)["peak_extra"] for case, line in zip(cases, lines, strict=True)}
