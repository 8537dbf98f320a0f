"""One elementwise template for `silu` and `sigmoid`: f(x) in fp32, returned in x.dtype.

An op supplies its formula twice: `value(x, ACC)`, a `triton.jit` function on a
block of fp32 values, and `reference(x32)`, the same formula in plain torch,
differentiated by autograd for the backward. Its kernel is one line, the shared
`elementwise_body` with its `value` (a kernel of its own, so that the compiled
binaries and the compile check's manifest name the op).

Elementwise: every element goes through the same instructions wherever it sits
in the tensor, so the op is position-invariant (no argument is specialised:
one binary for every size and offset). On a GPU the division is IEEE
(`div_rn`) and exp is `ex2.approx` (tests/gpu: within 2e-6 relative of fp64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.triton._common import tl_dtype
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

_BLOCK = 1024


# The arguments of every elementwise kernel: none is specialised, so every offset and size
# runs one binary.
ELEMENTWISE_ARGS = ["x_ptr", "out_ptr", "n"]


@triton.jit
def elementwise_body(x_ptr, out_ptr, n, FN: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = FN(x[i]) in ACC, for this program's BLOCK elements; an op's kernel is this
    call with its formula (`@triton.jit(do_not_specialize=ELEMENTWISE_ARGS, ...)`)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    y = FN(x, ACC)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def elementwise_launch(variant: str, kernel, x: torch.Tensor, out: torch.Tensor) -> Launch:
    """The launch of an op's elementwise `kernel` over the x.numel() elements of contiguous x."""
    n = x.numel()
    return Launch(
        variant=variant,
        kernel=kernel,
        grid=(triton.cdiv(n, _BLOCK),),
        args=(x, out, n),
        constexprs=dict(ACC=tl_dtype(at_least_fp32(x.dtype)), BLOCK=_BLOCK),
        num_warps=4,
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


def elementwise_forward(variant: str, kernel, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        elementwise_launch(variant, kernel, x, out).run()
    return out


def elementwise_function(variant: str, kernel, reference, module: str):
    """The autograd.Function of one elementwise op: the kernel forward, and the gradient of
    `reference` (the formula in plain torch, computed in fp32 and cast to x.dtype)."""

    class _InvariantElementwise(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return elementwise_forward(variant, kernel, x)

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                xg = x.detach().requires_grad_()
                y = reference(xg.to(at_least_fp32(x.dtype))).to(x.dtype)
                (grad_x,) = torch.autograd.grad(y, xg, grad_out)
            return grad_x

    _InvariantElementwise.__module__ = module
    _InvariantElementwise.__qualname__ = "_InvariantElementwise"
    return _InvariantElementwise
