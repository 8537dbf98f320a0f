"""Batch-invariant linear layer: y = x @ W^T + b, every row summed in a fixed order.

Forward goes through `fixed_order_matmul`, so a token's output bits do not depend
on the batch size, its position in the batch, the other rows or the thread
count. Backward uses plain GEMMs: it must be accurate and deterministic, not
batch-invariant (gradients are summed over the batch anyway).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.native._checks import at_least_fp32, check_projection
from rl_engine.kernels.native._gemm import fixed_order_matmul


def linear_forward(x2d, weight, bias, out_dtype):
    out = fixed_order_matmul(x2d, weight, out_dtype=out_dtype)  # (M, N)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def linear_backward(grad_out, x2d, weight, needs_bias_grad):
    grad_out = grad_out.to(weight.dtype)  # (M, N)
    grad_x = grad_out @ weight  # (M, K)
    grad_weight = grad_out.t() @ x2d  # (N, K)
    grad_bias = grad_out.sum(0) if needs_bias_grad else None
    return grad_x, grad_weight, grad_bias


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x2d, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        needs_bias = ctx.has_bias and ctx.needs_input_grad[2]
        grad_x, grad_weight, grad_bias = linear_backward(grad_out, x2d, weight, needs_bias)
        if not ctx.needs_input_grad[1]:
            grad_weight = None
        return grad_x, grad_weight, grad_bias, None


def _apply(x, weight, bias, out_dtype):
    check_projection("x", x, weight, bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    out = _InvariantLinear.apply(x2d, weight, bias, out_dtype)
    return out.reshape(*lead, weight.shape[0])


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
