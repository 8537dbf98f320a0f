"""The `linear` and `lm_head` ops, written once: signature, checks, backward, autograd.Function.

Forward is the backend's (its fixed-order matmul: that is where the bits are
decided), `linear_forward(x2d, weight, bias, out_dtype)`. Backward is plain torch
GEMMs: accurate and deterministic run to run, not batch-invariant (gradients are
summed over the batch anyway), so every backend shares it. `lm_head` is the same
projection kept in fp32 (fp64 for fp64): logits never pass through a bf16 rounding
of the full sum.

Layout-invariant mode (`spans=`, `sink=`; docs/operators.md): the backward sends each
sequence's weight partial dy_s^T x_s (role "linear", or "lm_head") and bias partial
(role "bias") to the sink, returns None for them, and computes grad_x = grad_out @ W
row-invariantly, all through the backend's `ExactGemm` (common/sequence_grads.py).

A backend's `Projection` is the projection without checks or guard: what the ops
that build on it (`moe_router`, `moe_experts`) call, so that one guard at their own
entry decides for the whole op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_engine.kernels.common.checks import at_least_fp32, check_projection
from rl_engine.kernels.common.op import Serving, define_op
from rl_engine.kernels.common.sequence_grads import (
    ExactGemm,
    input_grad,
    row_sums,
    span_rows,
    transposed,
    weight_partials,
)
from rl_engine.kernels.common.sequence_spans import check_sequence_mode, placeholder_grad


def linear_backward(grad_out, x2d, weight, needs_bias_grad):
    grad_out = grad_out.to(weight.dtype)  # (M, N)
    grad_x = grad_out @ weight  # (M, K)
    grad_weight = grad_out.t() @ x2d  # (N, K)
    grad_bias = grad_out.sum(0) if needs_bias_grad else None
    return grad_x, grad_weight, grad_bias


def invariant_linear_function(linear_forward, module: str) -> type[torch.autograd.Function]:
    """`_InvariantLinear` of the backend `module`: forward `linear_forward(x2d, weight, bias, out_dtype)`,
    backward `linear_backward`."""

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

    _InvariantLinear.__module__, _InvariantLinear.__qualname__ = module, "_InvariantLinear"
    return _InvariantLinear


def sequence_linear_backward(
    gemm: ExactGemm, grad_out, x2d, weight, bias, spans, sink, role, needs
):
    """Layout-invariant mode: grad_x (row-invariant) or None; the weight's and bias's
    per-sequence partials go to `sink` (only where `needs` says they are trainable)."""
    acc = at_least_fp32(weight.dtype)
    grad_x = None
    if needs[0]:
        grad_x = input_grad(gemm, grad_out, transposed(weight, weight.dtype), x2d.dtype)
    if needs[1]:
        for index, partial in weight_partials(gemm, grad_out, x2d, spans):
            sink.add(weight, role, index, partial)
    if bias is not None and needs[2]:
        sums = row_sums(grad_out.to(acc), span_rows(spans))  # (S, N)
        for i, index in enumerate(spans.indices):
            sink.add(bias, "bias", index, sums[i])
    return grad_x


def sequence_linear_function(
    linear_forward, gemm: ExactGemm, module: str
) -> type[torch.autograd.Function]:
    """`_SequenceLinear` of the backend `module`: its forward, `sequence_linear_backward`."""

    class _SequenceLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x2d, weight, bias, out_dtype, spans, sink, role):
            ctx.save_for_backward(x2d)
            ctx.params, ctx.mode = (weight, bias), (spans, sink, role)
            return linear_forward(x2d, weight, bias, out_dtype)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            (x2d,) = ctx.saved_tensors
            weight, bias = ctx.params
            spans, sink, role = ctx.mode
            grad_x = sequence_linear_backward(
                gemm, grad_out, x2d, weight, bias, spans, sink, role, ctx.needs_input_grad[:3]
            )
            needs = ctx.needs_input_grad
            return (
                grad_x,
                placeholder_grad(sink, weight, needs[1]),
                placeholder_grad(sink, bias, needs[2]),
                None,
                None,
                None,
                None,
            )

    _SequenceLinear.__module__, _SequenceLinear.__qualname__ = module, "_SequenceLinear"
    return _SequenceLinear


@dataclass(frozen=True, slots=True)
class Projection:
    """A backend's projection, unchecked: x (..., K) @ weight (N, K)^T + bias -> (..., N)."""

    forward: Callable
    """`linear_forward(x2d, weight, bias, out_dtype)`: the backend's kernel."""
    function: type[torch.autograd.Function]
    sequence_function: type[torch.autograd.Function] | None = None
    """The layout-invariant mode's autograd.Function; None: the backend has none (it raises)."""
    gemm: ExactGemm | None = None
    """The backend's exact GEMM (the layout-invariant backward's), or None."""

    def __call__(
        self, x, weight, bias=None, out_dtype=None, *, spans=None, sink=None, role="linear"
    ) -> torch.Tensor:
        """In `out_dtype` (x.dtype when None); through the autograd.Function only when a
        gradient is wanted (rollout decode skips its cost; the forward is the same).
        With spans and a sink: the layout-invariant backward (`sequence_linear_backward`)."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        x2d = x.reshape(-1, x.shape[-1])
        tracked = (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if not (torch.is_grad_enabled() and tracked):
            out = self.forward(x2d, weight, bias, out_dtype)
        elif sink is None:
            out = self.function.apply(x2d, weight, bias, out_dtype)
        else:
            out = self.sequence_function.apply(x2d, weight, bias, out_dtype, spans, sink, role)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def check_sequence_mode(self, op: str, x, spans, sink) -> None:
        """Raises on half a mode, spans of another row count, or a backend without the mode."""
        if (
            check_sequence_mode(op, spans, sink, math.prod(x.shape[:-1]))
            and self.sequence_function is None
        ):
            raise NotImplementedError(
                f"{op}: this backend ({self.function.__module__}) has no layout-invariant "
                "backward (spans / sink); use the cpp backend"
            )


def projection(linear_forward, module: str, gemm: ExactGemm | None = None) -> Projection:
    """The backend `module`'s Projection around its `linear_forward`; with `gemm` (its exact
    GEMM) it also serves the layout-invariant mode."""
    sequence_function = (
        None if gemm is None else sequence_linear_function(linear_forward, gemm, module)
    )
    return Projection(
        linear_forward,
        invariant_linear_function(linear_forward, module),
        sequence_function,
        gemm,
    )


def linear_op(project: Projection, serving: Serving, module: str):
    """The backend `module`'s public `linear`."""

    def build(guard):
        def linear(
            x: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None = None,
            *,
            spans=None,
            sink=None,
        ) -> torch.Tensor:
            """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype. With spans (a
            SequenceSpans over x's flattened rows) and a sink: the layout-invariant backward."""
            check_projection("x", x, weight, bias)
            guard("x", x)
            project.check_sequence_mode("linear", x, spans, sink)
            return project(x, weight, bias, spans=spans, sink=sink)

        return linear

    return define_op("linear", module, serving, build)


def lm_head_op(project: Projection, serving: Serving, module: str):
    """The backend `module`'s public `lm_head`."""

    def build(guard):
        def lm_head(
            hidden: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None = None,
            *,
            spans=None,
            sink=None,
        ) -> torch.Tensor:
            """Vocabulary projection: hidden (..., H), weight (V, H) -> fp32 logits (..., V)
            (fp64 for fp64). The same reduction as `linear`, without the final rounding to
            the input dtype. Tied weights work: `weight` may be the embedding matrix.
            spans / sink: as `linear` (the weight's role is "lm_head")."""
            check_projection("x", hidden, weight, bias)
            guard("x", hidden)
            project.check_sequence_mode("lm_head", hidden, spans, sink)
            out_dtype = at_least_fp32(hidden.dtype)
            return project(hidden, weight, bias, out_dtype, spans=spans, sink=sink, role="lm_head")

        return lm_head

    return define_op("lm_head", module, serving, build)
