"""Batch-invariant linear layer: y = x @ W^T + b, every row summed in a fixed order.

Forward goes through the fixed-shape tile scheme (`_tiles.tiled_matmul`, see
`_gemm.py`), so a token's output bits do not depend on the batch size, its
position in the batch, the other rows or the thread count, where this machine's
platform probe accepts the dtype (the ops' guard asks it first: `_serving.GEMM`).
`lm_head` is the same reduction kept in fp32 (bf16 slices are summed in fp32), so
logits never pass through a bf16 rounding of the full sum. Backward uses plain
GEMMs: it must be accurate and deterministic, not batch-invariant (gradients are
summed over the batch anyway); it, the autograd.Function and the ops' signature
and checks are shared by every backend (rl_engine/kernels/common/linear.py). The
layout-invariant mode (`spans=`, `sink=`) runs its backward through `exact_gemm`.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.linear import linear_op, lm_head_op, projection
from rl_engine.kernels.native._serving import GEMM
from rl_engine.kernels.native._tiles import accumulator_dtype, tiled_matmul
from rl_engine.kernels.native.platform_probe import require_invariant_platform


def linear_forward(x2d, weight, bias, out_dtype):
    out = tiled_matmul(x2d, weight, out_dtype=out_dtype)  # (M, N)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def exact_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The layout-invariant backward's GEMM (common/sequence_grads.py, `ExactGemm`): a (M, K)
    @ b (N, K)^T -> fp32 (M, N) through the tile scheme in fp32 (bf16 / fp16 operands
    converted exactly: bf16 tiles would round each K slice's product to bf16), fp64 for
    fp64. A row's bits then follow from its own row, K and N, where this machine's probe
    accepts the accumulation dtype (else PlatformInvarianceError)."""
    acc = accumulator_dtype(a.dtype)
    require_invariant_platform(acc, a.device)
    return tiled_matmul(a.to(acc), b.to(acc), out_dtype=acc)


PROJECTION = projection(linear_forward, __name__, exact_gemm)
linear = linear_op(PROJECTION, GEMM, __name__)
lm_head = lm_head_op(PROJECTION, GEMM, __name__)
