"""SiLU on the GPU: x / (1 + exp(-x)) in fp32, returned in x.dtype.

The elementwise template (`_elementwise.py`: one kernel body, no argument
specialised, IEEE division) with this formula; backward: autograd through the
same formula in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.triton._common import SERVING, div_rn
from rl_engine.kernels.triton._elementwise import (
    ELEMENTWISE_ARGS,
    elementwise_body,
    elementwise_function,
)


@triton.jit
def silu_value(x, ACC: tl.constexpr):
    return div_rn(x, 1.0 + tl.exp(-x), ACC)


@triton.jit(do_not_specialize=ELEMENTWISE_ARGS, do_not_specialize_on_alignment=ELEMENTWISE_ARGS)
def _silu_kernel(x_ptr, out_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    elementwise_body(x_ptr, out_ptr, n, silu_value, ACC, BLOCK)


def silu_reference(x32: torch.Tensor) -> torch.Tensor:
    return x32 / (1.0 + torch.exp(-x32))


_InvariantSiLU = elementwise_function("silu", _silu_kernel, silu_reference, __name__)
silu_forward = _InvariantSiLU.apply
silu = elementwise_op("silu", silu_forward, SERVING, __name__)
