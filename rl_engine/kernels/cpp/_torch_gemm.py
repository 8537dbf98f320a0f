"""The torch GEMM behind the cpp backend's fp64 / fp16 inputs: NOT row-invariant, opt-in only.

The C++ kernels serve fp32 and bf16 only. Other dtypes run this padded,
K-sliced `F.linear` (at least MIN_ROWS rows a call, K in K_SLICE columns): the
call's M follows the batch, and the library picks its kernel (and so a row's
summation order) from M. It is therefore not row-invariant, and the cpp GEMM ops
refuse fp64 / fp16 with NonInvariantDtypeError (`_serving.GEMM`) unless the
caller asks for it with `get_op(..., allow_non_invariant=True)` (gradcheck in
fp64). The tests check it only for accuracy (gradcheck), never for invariance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.kernels.common.cpu_flags import cpu_flags

# Calls carry at least this many rows (tiny batches are zero-padded).
MIN_ROWS = 16
# Reduction slice width; 16-bit dtypes on AMX CPUs use the narrower one.
K_SLICE = 1024
K_SLICE_16BIT_AMX = 256


def _k_slice_for(dtype: torch.dtype) -> int:
    if dtype in (torch.bfloat16, torch.float16) and "amx_bf16" in cpu_flags():
        return K_SLICE_16BIT_AMX
    return K_SLICE


def padded_sliced_matmul(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) in `out_dtype`."""
    rows, k = x.shape
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, k)])
    width = _k_slice_for(x.dtype)
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
