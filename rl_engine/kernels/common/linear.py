"""The parts of the batch-invariant linear op that do not depend on the backend.

Forward is the backend's (its fixed-order matmul: that is where the bits are
decided). Backward is plain torch GEMMs: accurate and deterministic run to run,
not batch-invariant (gradients are summed over the batch anyway), so every
backend shares it.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_projection


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


def project(function, x, weight, bias, out_dtype, check_device=None):
    """Shared by `linear` and `lm_head`: validate, flatten the rows, `function.apply`, restore.

    `check_device(name, tensor)`, when given, is the backend's device check.
    """
    check_projection("x", x, weight, bias)
    if check_device is not None:
        check_device("x", x)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    out = function.apply(x2d, weight, bias, out_dtype)
    return out.reshape(*lead, weight.shape[0])
