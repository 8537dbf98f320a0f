"""The torch GEMM behind the cpp backend's fp64 / fp16 inputs (gradcheck, rare).

The C++ kernels serve fp32 and bf16 only. Other dtypes run this padded,
K-sliced `F.linear`: it is the `native` backend's GEMM as it was before issue
15, kept here unchanged so that the cpp backend's bits stay what they were
(`cpp_numerics` names them). It is NOT the native contract any more: native
moved to fixed-shape row tiles (rl_engine/kernels/native/_gemm.py), because on an
AMX Xeon a 16-row and a 64-row call of this scheme summed a row differently.
The cpp tests check fp64 / fp16 only for accuracy (gradcheck), not invariance.
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
