"""Batch-invariant linear layer: y = x @ W^T + b, every row summed in a fixed order.

Forward goes through `fixed_order_matmul`, so a token's output bits do not depend
on the batch size, its position in the batch, the other rows or the thread
count. Backward uses plain GEMMs: it must be accurate and deterministic, not
batch-invariant (gradients are summed over the batch anyway); it and the
autograd.Function are shared by every backend (rl_engine/kernels/common/linear.py).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.linear import (
    invariant_linear_function,
    linear_backward,  # noqa: F401  (the op's backward)
    project,
)
from rl_engine.kernels.native._gemm import fixed_order_matmul


def linear_forward(x2d, weight, bias, out_dtype):
    out = fixed_order_matmul(x2d, weight, out_dtype=out_dtype)  # (M, N)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


_InvariantLinear = invariant_linear_function(linear_forward, __name__)


def _apply(x, weight, bias, out_dtype):
    return project(_InvariantLinear, x, weight, bias, out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype."""
    return _apply(x, weight, bias, x.dtype)


def lm_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Vocabulary projection: hidden (..., H), weight (V, H) -> fp32 logits (..., V) (fp64 for fp64).

    Same fixed-order reduction as `linear`; the result is kept in fp32 (bf16
    slices are summed in fp32), so logits never pass through a bf16 rounding of
    the full sum. Works with tied weights: `weight` may be the embedding matrix.
    """
    return _apply(hidden, weight, bias, at_least_fp32(hidden.dtype))
