"""SiLU on the GPU: x / (1 + exp(-x)) in fp32, returned in x.dtype.

Elementwise: every element goes through the same instructions wherever it sits
in the tensor, so the op is position-invariant (no argument is specialised:
one binary for every size and offset). On a GPU the division is IEEE
(`div_rn`) and exp is `ex2.approx` (tests/gpu: within 2e-6 relative of fp64).
Backward: autograd through the same formula in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.checks import at_least_fp32, check_floating
from rl_engine.kernels.triton._common import check_device, div_rn, tl_dtype
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

_BLOCK = 1024


_ARGS = ["x_ptr", "out_ptr", "n"]


# nothing specialised: every offset and size runs one binary
@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _silu_kernel(x_ptr, out_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    y = div_rn(x, 1.0 + tl.exp(-x), ACC)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_launch(x: torch.Tensor, out: torch.Tensor) -> Launch:
    """The launch that writes out = silu(x) over the x.numel() elements of contiguous x."""
    n = x.numel()
    return Launch(
        variant="silu",
        kernel=_silu_kernel,
        grid=(triton.cdiv(n, _BLOCK),),
        args=(x, out, n),
        constexprs=dict(ACC=tl_dtype(at_least_fp32(x.dtype)), BLOCK=_BLOCK),
        num_warps=4,
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


def silu_forward(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        silu_launch(x, out).run()
    return out


class _InvariantSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_forward(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xg = x.detach().requires_grad_()
            x32 = xg.to(at_least_fp32(x.dtype))
            y = (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)
            (grad_x,) = torch.autograd.grad(y, xg, grad_out)
        return grad_x


def silu(x: torch.Tensor) -> torch.Tensor:
    """Elementwise SiLU in fp32, returned in x.dtype."""
    check_floating("x", x)
    check_device("x", x)
    return _InvariantSiLU.apply(x)
