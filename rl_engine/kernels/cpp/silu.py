"""SiLU on CPU through one vector code path for every element (csrc/kernels_impl.h).

silu(x) = x / (1 + exp(-x)) in fp32, with the kernels' own exp (range
reduction + polynomial, the same operations on every ISA). torch's `F.silu`
runs the tail of each loop through scalar code whose bits differ from the SIMD
body, and which elements fall in the tail depends on the size and the thread
split; here the tail is computed by the same vector code on a zero-padded
copy, so every element's bits depend on its value alone. bf16 is read, computed
in fp32 and rounded once (no fp32 intermediate tensors: the native backend's
12x cost in bf16). fp64 and fp16 run the native formulation (invariant too, with
native's bits).

Backward: d silu / dx = s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)), in fp32
with plain torch ops: `exp`, `+`, `-`, `*` and `/`, whose vector and scalar loop
paths give the same bits, so a token's gradient depends on its own values alone
(row-invariant, as layout-invariant training needs). `torch.sigmoid` is not: its
loop tail differs in the last bit from its body (tests/kernels/test_sequence_backward.py).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp._serving import KERNEL_DTYPES, KERNELS
from rl_engine.kernels.native.silu import silu_forward as native_silu_forward


def silu_kernel(x: torch.Tensor) -> torch.Tensor:
    return extension().silu(x, current_isa())


def silu_backward(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    s = 1.0 / (1.0 + torch.exp(-x32))
    return (grad_out.float() * s * (1.0 + x32 * (1.0 - s))).to(x.dtype)


class _FixedOrderSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_kernel(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return silu_backward(grad_out, x)


def silu_forward(x: torch.Tensor) -> torch.Tensor:
    """The kernel for fp32 / bf16, native's formulation for fp64 / fp16; differentiable."""
    if x.dtype not in KERNEL_DTYPES:
        return native_silu_forward(x)
    return _FixedOrderSiLU.apply(x)


silu = elementwise_op("silu", silu_forward, KERNELS, __name__)
