"""Batch-invariant linear layer on CPU through the fixed-order C++ GEMM.

Every output element y[m, n] is one serial chain over K computed by one code
path (csrc/gemm_impl.h, "serial K chain"): fp32 acc = +0, then acc =
fma(x[m, k], w[n, k], acc) for k = 0 .. K-1 in increasing order; bf16 by
pairs in increasing order, odd element first (VDPBF16PS), accumulated in fp32.
Blocking, packing and threads only split output blocks (and store / reload
the exact fp32 accumulator between K blocks), so a row has the same bits for
M = 1 (decode) and M = 4096 (training), at any row position, next to any
rows, with any thread count, and without padding small batches. bf16
products are exact and summed in fp32: the result is rounded once, at the end
(to bf16 for `linear`, kept in fp32 for `lm_head`).

fp64 and fp16 (gradcheck, rare) go through the native fixed-order GEMM.
Backward is the native one: plain GEMMs, accurate and deterministic; gradients
are summed over the batch, so they need not be batch-invariant.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.native._checks import at_least_fp32, check_projection
from rl_engine.kernels.native._gemm import fixed_order_matmul
from rl_engine.kernels.native.linear import linear_backward

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def fixed_order_gemm(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> fp32 (M, N); fp64 stays fp64."""
    if x2d.dtype not in KERNEL_DTYPES or x2d.device.type != "cpu":
        return fixed_order_matmul(x2d, weight, out_dtype=at_least_fp32(x2d.dtype))
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return extension().gemm(x2d, weight, current_isa())


def linear_forward(x2d, weight, bias, out_dtype):
    out = fixed_order_gemm(x2d, weight).to(out_dtype)  # (M, N)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


class _FixedOrderLinear(torch.autograd.Function):
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
    tracked = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and tracked:
        out = _FixedOrderLinear.apply(x2d, weight, bias, out_dtype)
    else:  # inference (rollout decode): the same forward, without the autograd.Function cost
        out = linear_forward(x2d, weight, bias, out_dtype)
    return out.reshape(*lead, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype."""
    return _apply(x, weight, bias, x.dtype)


def lm_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Vocabulary projection: hidden (..., H), weight (V, H) -> fp32 logits (..., V) (fp64 for fp64).

    The same kernel as `linear`, without the final rounding to bf16.
    """
    return _apply(hidden, weight, bias, at_least_fp32(hidden.dtype))
