"""The `rms_norm` op, written once: HF semantics (fp32 statistics, normalised value cast back, * weight).

The backend supplies `rms_norm_forward(x, weight, eps)` (differentiable, any
leading dims, at least one element); the checks and the empty case are here.

Layout-invariant mode (`spans=`, `sink=` over x's flattened rows): grad_x is autograd's
through the backend's forward with the weight held constant (the very ops, and bits, of
the plain backward's grad_x), and each sequence's weight partial goes to the sink (role
"rms_norm"): +0, then + grad_out[row] * normed[row] for its rows in order, in fp32 (fp64
for fp64), where normed is the forward's normalised value cast to x's dtype (the
backend's forward with a weight of ones: 1 * n == n) and the product is taken in fp32
(exact for bf16 operands).
"""

from __future__ import annotations

import math

import torch

from rl_engine.kernels.common.checks import at_least_fp32, check_floating, check_last_dim
from rl_engine.kernels.common.op import Serving, define_op
from rl_engine.kernels.common.sequence_grads import row_sums, span_rows
from rl_engine.kernels.common.sequence_spans import check_sequence_mode, placeholder_grad


def sequence_rms_norm_backward(rms_norm_forward, grad_out, x, weight, eps, spans, sink, needs):
    """grad_x (or None); the weight's per-sequence partials go to the sink."""
    grad_x = None
    if x.numel() == 0:  # no rows: no gradient to x; every sequence's partial is +0
        grad_x = torch.zeros_like(x) if needs[0] else None
        x = x.reshape(0, weight.shape[0])
        grad_out = grad_out.reshape(0, weight.shape[0])
    elif needs[0]:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            out = rms_norm_forward(leaf, weight.detach(), eps)
            (grad_x,) = torch.autograd.grad(out, leaf, grad_out)
    if needs[1]:
        acc = at_least_fp32(weight.dtype)
        with torch.no_grad():
            normed = rms_norm_forward(x.detach(), torch.ones_like(weight), eps) if x.numel() else x
        width = x.shape[-1]
        products = grad_out.reshape(-1, width).to(acc) * normed.reshape(-1, width).to(acc)
        sums = row_sums(products, span_rows(spans))  # (S, H)
        for i, index in enumerate(spans.indices):
            sink.add(weight, "rms_norm", index, sums[i])
    return grad_x


def sequence_rms_norm_function(rms_norm_forward, module: str) -> type[torch.autograd.Function]:
    """`_SequenceRMSNorm` of the backend `module`: its forward, `sequence_rms_norm_backward`."""

    class _SequenceRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps, spans, sink):
            ctx.save_for_backward(x)
            ctx.weight, ctx.mode = weight, (eps, spans, sink)
            with torch.no_grad():
                return rms_norm_forward(x, weight, eps) if x.numel() else x * weight

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            eps, spans, sink = ctx.mode
            needs = ctx.needs_input_grad[:2]
            grad_x = sequence_rms_norm_backward(
                rms_norm_forward, grad_out, x, ctx.weight, eps, spans, sink, needs
            )
            return grad_x, placeholder_grad(sink, ctx.weight, needs[1]), None, None, None

    _SequenceRMSNorm.__module__, _SequenceRMSNorm.__qualname__ = module, "_SequenceRMSNorm"
    return _SequenceRMSNorm


def rms_norm_op(rms_norm_forward, serving: Serving, module: str):
    """The public `rms_norm` of the backend `module`."""
    sequence_function = sequence_rms_norm_function(rms_norm_forward, module)

    def build(guard):
        def rms_norm(
            x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, spans=None, sink=None
        ) -> torch.Tensor:
            """x (..., H), weight (H,) -> (..., H) (HF LlamaRMSNorm semantics). With spans
            (over x's flattened rows) and a sink: the layout-invariant backward."""
            check_floating("x", x)
            check_floating("weight", weight)
            check_last_dim("x", x, weight.shape[-1], "the norm weight's size")
            guard("x", x)
            if check_sequence_mode("rms_norm", spans, sink, math.prod(x.shape[:-1])):
                return sequence_function.apply(x, weight, eps, spans, sink)
            if x.shape[-1] == 0 or x.numel() == 0:
                return x * weight
            return rms_norm_forward(x, weight, eps)

        return rms_norm

    return define_op("rms_norm", module, serving, build)
