"""Batch-invariant linear layer: y = x @ W^T + b, every row summed in a fixed order.

Forward goes through the fixed-shape tile scheme (`_tiles.tiled_matmul`, see
`_gemm.py`), so a token's output bits do not depend on the batch size, its
position in the batch, the other rows or the thread count, where this machine's
platform probe accepts the dtype (the ops' guard asks it first: `_serving.GEMM`).
`lm_head` is the same reduction kept in fp32 (bf16 slices are summed in fp32), so
logits never pass through a bf16 rounding of the full sum. Backward uses plain
GEMMs: it must be accurate and deterministic, not batch-invariant (gradients are
summed over the batch anyway); it, the autograd.Function and the ops' signature
and checks are shared by every backend (rl_engine/kernels/common/linear.py).
"""

from __future__ import annotations

from rl_engine.kernels.common.linear import linear_op, lm_head_op, projection
from rl_engine.kernels.native._serving import GEMM
from rl_engine.kernels.native._tiles import tiled_matmul


def linear_forward(x2d, weight, bias, out_dtype):
    out = tiled_matmul(x2d, weight, out_dtype=out_dtype)  # (M, N)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


PROJECTION = projection(linear_forward, __name__)
linear = linear_op(PROJECTION, GEMM, __name__)
lm_head = lm_head_op(PROJECTION, GEMM, __name__)
