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

import torch
import torch.nn.functional as F

# Below this many rows MKL/oneDNN switch to GEMV / small-M kernels (measured:
# M <= 5 fp32 and M = 1 bf16 changed row bits; 16 rows never did).
MIN_ROWS = 16

# Reduction slice width. FACTS.md saw MKL split reductions of K >= 2048 across
# threads; slices of <= 1024 never were (1-4 threads). Models with hidden <= 1024
# pay nothing for it: their projections are a single slice. See docs/operators.md.
K_SLICE = 1024


def fixed_order_matmul(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) in `out_dtype`, row-invariant."""
    rows, k = x.shape
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, k)])
    if k <= K_SLICE:
        out = F.linear(x, weight)
    else:
        out = _sliced_matmul(x, weight)
    return out[:rows].to(out_dtype)


def _sliced_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Sum of per-slice GEMMs in fp32 (fp64 for fp64 inputs), slice 0 first."""
    k = x.shape[1]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = F.linear(x[:, :K_SLICE], weight[:, :K_SLICE]).to(acc_dtype)  # (M, N)
    for start in range(K_SLICE, k, K_SLICE):
        stop = start + K_SLICE
        if x.dtype == acc_dtype:
            acc.addmm_(x[:, start:stop], weight[:, start:stop].t())
        else:
            # bf16/fp16 slices come back rounded to their dtype; the running sum is fp32.
            acc.add_(F.linear(x[:, start:stop], weight[:, start:stop]))
    return acc
