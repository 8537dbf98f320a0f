"""Rows for the row-wise ops' tests (rms_norm, silu, sigmoid, log_softmax, embedding), the check that
a row's bits do not depend on its batch, and a `Serving` that refuses bf16 and fp16, for the tests
of the ops' shared builders (common/<op>.py) around a real backend forward."""

from __future__ import annotations

import torch

from rl_engine.kernels.common.op import Serving
from tests.helpers.invariance import garbage_like, probe_batches

BATCH_SIZES = [1, 2, 3, 8, 33, 128, 1000, 4096]
MAX_BATCH_ELEMENTS = 50_000_000  # skip batch sizes whose (rows x width) would not fit comfortably

FP32_ONLY = Serving(
    backend="test",
    invariant_dtypes=(torch.float32, torch.float64),
    otherwise="the test's forward without the guarantee",
)


def rows(width, dtype, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g) * 3).to(dtype)


def assert_row_invariant(fn, pool):
    """fn(probe alone) == fn(batch)[row] for batches of every size, garbage rows included."""
    probe = pool[5]
    alone = fn(probe[None])[0]
    sizes = [n for n in BATCH_SIZES if n * pool.shape[1] <= MAX_BATCH_ELEMENTS]
    for batch, row in probe_batches(probe, pool, sizes):
        assert torch.equal(fn(batch)[row], alone), f"batch of {batch.shape[0]}, row {row}"
        noisy = garbage_like(batch)
        noisy[row] = probe
        assert torch.equal(fn(noisy)[row], alone)
