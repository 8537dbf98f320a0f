"""The `linear` and `lm_head` ops, written once: signature, checks, backward, autograd.Function.

Forward is the backend's (its fixed-order matmul: that is where the bits are
decided), `linear_forward(x2d, weight, bias, out_dtype)`. Backward is plain torch
GEMMs: accurate and deterministic run to run, not batch-invariant (gradients are
summed over the batch anyway), so every backend shares it. `lm_head` is the same
projection kept in fp32 (fp64 for fp64): logits never pass through a bf16 rounding
of the full sum.

A backend's `Projection` is the projection without checks or guard: what the ops
that build on it (`moe_router`, `moe_experts`) call, so that one guard at their own
entry decides for the whole op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_engine.kernels.common.checks import at_least_fp32, check_projection
from rl_engine.kernels.common.op import Serving, define_op


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


@dataclass(frozen=True, slots=True)
class Projection:
    """A backend's projection, unchecked: x (..., K) @ weight (N, K)^T + bias -> (..., N)."""

    forward: Callable
    """`linear_forward(x2d, weight, bias, out_dtype)`: the backend's kernel."""
    function: type[torch.autograd.Function]

    def __call__(self, x, weight, bias=None, out_dtype=None) -> torch.Tensor:
        """In `out_dtype` (x.dtype when None); through the autograd.Function only when a
        gradient is wanted (rollout decode skips its cost; the forward is the same)."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        x2d = x.reshape(-1, x.shape[-1])
        tracked = (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if torch.is_grad_enabled() and tracked:
            out = self.function.apply(x2d, weight, bias, out_dtype)
        else:
            out = self.forward(x2d, weight, bias, out_dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])


def projection(linear_forward, module: str) -> Projection:
    """The backend `module`'s Projection around its `linear_forward`."""
    return Projection(linear_forward, invariant_linear_function(linear_forward, module))


def linear_op(project: Projection, serving: Serving, module: str):
    """The backend `module`'s public `linear`."""

    def build(guard):
        def linear(
            x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype."""
            check_projection("x", x, weight, bias)
            guard("x", x)
            return project(x, weight, bias)

        return linear

    return define_op("linear", module, serving, build)


def lm_head_op(project: Projection, serving: Serving, module: str):
    """The backend `module`'s public `lm_head`."""

    def build(guard):
        def lm_head(
            hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            """Vocabulary projection: hidden (..., H), weight (V, H) -> fp32 logits (..., V)
            (fp64 for fp64). The same reduction as `linear`, without the final rounding to
            the input dtype. Tied weights work: `weight` may be the embedding matrix."""
            check_projection("x", hidden, weight, bias)
            guard("x", hidden)
            return project(hidden, weight, bias, at_least_fp32(hidden.dtype))

        return lm_head

    return define_op("lm_head", module, serving, build)
