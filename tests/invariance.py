"""Helpers for batch-invariance tests: probe rows placed in other batches, and other thread counts.

Every comparison is `torch.equal`: invariance never has a tolerance.

`skip_if_refused` is the one place a test learns that the `native` backend's
platform probe refused a dtype on this machine (PlatformInvarianceError): the
test then skips with the probe's reason instead of failing. Where the probe
accepts the dtype the test runs, and must pass.
"""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from rl_engine.kernels import PlatformInvarianceError, get_op

REFUSAL = PlatformInvarianceError.__name__


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


def garbage_like(t: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t.shape, generator=g) * 1e4).to(t.dtype)


def run_with_threads(code: str, threads: int, timeout: float = 300):
    """Run `code` (which must assign `result`) in a fresh interpreter with `threads` intra-op threads."""
    script = (
        textwrap.dedent(
            f"""
        import pickle, sys, torch
        torch.set_num_threads({threads})
        """
        )
        + textwrap.dedent(code)
        + "\nsys.stdout.buffer.write(pickle.dumps(result))\n"
    )
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
