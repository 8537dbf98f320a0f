"""Batch-invariant linear layer on the GPU: y = x @ W^T + b through the persistent fixed-order matmul.

Forward: `_matmul.fixed_order_matmul` (constant tiles, no split-K, fp32
accumulation, bias added in fp32 before the single rounding to x.dtype), so a
row's bits do not depend on M, its position or the other rows (`lm_head.py`:
the same projection, fp32 logits). Backward:
plain torch GEMMs, deterministic run to run, not batch-invariant (gradients are
summed over the batch anyway); it, the autograd.Function and the ops' checks are
shared with every backend (rl_engine/kernels/common/linear.py). The
layout-invariant mode (`spans=`, `sink=`) runs its backward through
`_matmul.exact_gemm` (the forward's tiles and K order, one binary for every
shape), so a sequence's weight partial and a token's input gradient are chains
fixed by the sequence / the row alone.
"""

from __future__ import annotations

from rl_engine.kernels.common.linear import linear_op, projection
from rl_engine.kernels.triton._common import SERVING
from rl_engine.kernels.triton._matmul import exact_gemm, fixed_order_matmul


def linear_forward(x2d, weight, bias, out_dtype):
    return fixed_order_matmul(x2d, weight, bias, out_dtype=out_dtype)  # (M, N)


PROJECTION = projection(linear_forward, __name__, exact_gemm)
linear = linear_op(PROJECTION, SERVING, __name__)
