"""Fixed-order GEMM: the one place that decides how a row's dot products are summed.

Plain `F.linear` on this CPU picks its kernel from the whole call's shape: one
row takes a GEMV path, a few rows take small-matrix kernels, and long reductions
may be split across threads. Each choice sums a row's products in a different
order, so a token's result depends on what else is in the batch.

`fixed_order_matmul` removes every such degree of freedom:
- calls always carry at least `MIN_ROWS` rows (tiny batches are zero-padded), so
  the small-M kernels are never chosen;
- the reduction (K) dimension is cut into slices of at most `K_SLICE` columns
  that start at column 0, each slice is one GEMM too short for any library to
  split across threads, and the slices are summed in fp32 in increasing order.
The slicing depends on K alone, never on the number of rows or threads.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

# Below this many rows MKL/oneDNN switch to GEMV / small-M kernels (measured on
# this machine kind: with 2 threads fp32 rows changed bits for M <= 10; M = 1
# bf16 too; M >= 12 never did, for K up to 8192 and 1-4 threads).
MIN_ROWS = 16

# Reduction slice width. docs/platform-facts.md saw MKL split reductions of K >= 2048 across
# threads; slices of <= 1024 never were (1-4 threads). Models with hidden <= 1024
# pay nothing for it: their projections are a single slice. See docs/operators.md.
K_SLICE = 1024

# On CPUs with AMX (Xeon Sapphire Rapids and later) docs/platform-facts.md measured oneDNN's
# bf16 GEMM changing a row's bits with M once K >= 512; slices below that did not.
# This machine kind (AMD EPYC, AVX512-BF16) showed no such dependence up to K = 8192.
K_SLICE_16BIT_AMX = 256


@cache
def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def k_slice_for(dtype: torch.dtype) -> int:
    """Reduction slice width used for `dtype` on this machine."""
    if dtype in (torch.bfloat16, torch.float16) and _cpu_has_amx():
        return K_SLICE_16BIT_AMX
    return K_SLICE


def fixed_order_matmul(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) in `out_dtype`, row-invariant."""
    rows, k = x.shape
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, k)])
    width = k_slice_for(x.dtype)
    if k <= width:
        out = F.linear(x, weight)
    else:
        out = _sliced_matmul(x, weight, width)
    return out[:rows].to(out_dtype)


def _sliced_matmul(x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
    """Sum of per-slice GEMMs in fp32 (fp64 for fp64 inputs), slice 0 first."""
    k = x.shape[1]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = F.linear(x[:, :width], weight[:, :width]).to(acc_dtype)  # (M, N)
    for start in range(width, k, width):
        stop = start + width
        if x.dtype == acc_dtype:
            acc.addmm_(x[:, start:stop], weight[:, start:stop].t())
        else:
            # bf16/fp16 slices come back rounded to their dtype; the running sum is fp32.
            acc.add_(F.linear(x[:, start:stop], weight[:, start:stop]))
    return acc
