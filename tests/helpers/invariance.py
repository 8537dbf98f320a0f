"""Helpers for batch-invariance tests: probe rows placed in other batches, and other thread counts.

Every comparison is `torch.equal`: invariance never has a tolerance.

`skip_if_refused` is the one place a test learns that the `native` backend's
platform probe refused a dtype on this machine (PlatformInvarianceError): the
test then skips with the probe's reason instead of failing. Where the probe
accepts the dtype the test runs, and must pass.
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rl_engine.kernels import PlatformInvarianceError, get_op
from tests.helpers.framed_process import FramedProcess

REFUSAL = PlatformInvarianceError.__name__
REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _native_refusal(dtype: torch.dtype, device: str) -> str | None:
    linear = get_op("linear", device, backend="native")
    try:
        linear(
            torch.zeros(1, 8, dtype=dtype, device=device),
            torch.zeros(2, 8, dtype=dtype, device=device),
        )
    except PlatformInvarianceError as err:
        return str(err)
    return None


def skip_if_refused(backend: str, dtype: torch.dtype | str, device: str = "cpu") -> None:
    """Skip the calling test, with the probe's reason, where `backend` refuses `dtype` here."""
    if backend != "native":
        return
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    reason = _native_refusal(dtype, device)
    if reason is not None:
        pytest.skip(f"{REFUSAL}: {reason}")


def probe_batches(probe: torch.Tensor, pool: torch.Tensor, sizes, seed: int = 0):
    """Yield (batch, row_index) with `probe` placed at a random row of batches drawn from `pool`."""
    g = torch.Generator().manual_seed(seed)
    for size in sizes:
        idx = torch.randint(0, pool.shape[0], (size,), generator=g)
        batch = pool[idx].clone()
        row = int(torch.randint(0, size, (1,), generator=g))
        batch[row] = probe
        yield batch, row


def plain_linear_depends_on_the_chunk(make_case) -> bool:
    """Negative control of a chunked logprob op: F.linear in one-row chunks (M = 1: a GEMV
    path) != F.linear on all rows at once, for some K of 32, 64, 300, 1024 (which shapes take
    another path differs between CPUs). `make_case(k)` gives (8 rows of width k, a weight)."""
    for k in (32, 64, 300, 1024):
        h, w = make_case(k)
        one_row_chunks = torch.cat([torch.nn.functional.linear(h[i : i + 1], w) for i in range(8)])
        if not torch.equal(one_row_chunks, torch.nn.functional.linear(h, w)):
            return True
    return False


def garbage_like(t: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t.shape, generator=g) * 1e4).to(t.dtype)


def _thread_worker(threads: int) -> FramedProcess:
    """One `tests.helpers.thread_worker` process at a fixed thread count, kept for the session."""
    command = [sys.executable, "-m", "tests.helpers.thread_worker", str(threads)]
    return FramedProcess(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


_WORKERS: dict[int, FramedProcess] = {}


@atexit.register
def _close_workers() -> None:
    for worker in _WORKERS.values():
        worker.close()


def run_with_threads(code: str, threads: int, timeout: float = 300, *, fresh: bool = False):
    """Run `code` (which must assign `result`) in an interpreter with `threads` intra-op threads.

    By default in this session's worker at that thread count (tests/helpers/thread_worker.py: a new
    namespace and torch's RNG seeded to 0 per snippet, the imports already done); `fresh=True`
    starts a new interpreter, for code whose environment must be read at import (an ISA override).
    """
    code = textwrap.dedent(code)
    if fresh:
        return _run_fresh(code, threads, timeout)
    worker = _WORKERS.get(threads)
    if worker is None or not worker.alive():
        worker = _WORKERS[threads] = _thread_worker(threads)
    try:
        status, value = worker.request(code, timeout)
    except RuntimeError:
        _WORKERS.pop(threads).close()
        raise
    if status == "error":
        _skip_if_platform_refused(value, threads)
        raise RuntimeError(f"snippet with {threads} threads failed:\n{value[-3000:]}")
    return value


def _run_fresh(code: str, threads: int, timeout: float):
    script = f"import pickle, sys, torch\ntorch.set_num_threads({threads})\n" + code
    script += "\nsys.stdout.buffer.write(pickle.dumps(result))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        _skip_if_platform_refused(proc.stderr.decode(), threads)
        raise RuntimeError(
            f"subprocess with {threads} threads failed:\n{proc.stderr.decode()[-3000:]}"
        )
    return pickle.loads(proc.stdout)


def assert_equal_across_threads(code: str, threads=(1, 2, 3)):
    """`result` (a tensor or a dict of tensors) is bitwise identical for every thread count."""
    results = {n: run_with_threads(code, n) for n in threads}
    first = results[threads[0]]
    for n in threads[1:]:
        other = results[n]
        if isinstance(first, dict):
            for key in first:
                assert torch.equal(first[key], other[key]), (
                    f"{key}: {threads[0]} vs {n} threads differ"
                )
        else:
            assert torch.equal(first, other), f"{threads[0]} vs {n} threads differ"
    return first


def _skip_if_platform_refused(stderr: str, threads: int) -> None:
    # The probe runs in the child too, with the child's thread count among those it checks.
    for line in reversed(stderr.splitlines()):
        if f"{REFUSAL}:" in line:
            pytest.skip(f"with {threads} threads: {line.strip()}")
