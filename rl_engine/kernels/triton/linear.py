"""Batch-invariant linear layer on the GPU: y = x @ W^T + b through the persistent fixed-order matmul.

Forward: `_matmul.fixed_order_matmul` (constant tiles, no split-K, fp32
accumulation, bias added in fp32 before the single rounding to x.dtype), so a
row's bits do not depend on M, its position or the other rows. Backward: plain
torch GEMMs, deterministic run to run, not batch-invariant (gradients are
summed over the batch anyway).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.native._checks import check_projection
from rl_engine.kernels.triton._common import check_device
from rl_engine.kernels.triton._matmul import fixed_order_matmul


def linear_forward(x2d, weight, bias, out_dtype):
    return fixed_order_matmul(x2d, weight, bias, out_dtype=out_dtype)  # (M, N)


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


def apply_projection(x, weight, bias, out_dtype):
    """Shared by `linear` and `lm_head`: validate, flatten the rows, project."""
    check_projection("x", x, weight, bias)
    check_device("x", x)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    out = _InvariantLinear.apply(x2d, weight, bias, out_dtype)
    return out.reshape(*lead, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype."""
    return apply_projection(x, weight, bias, x.dtype)
