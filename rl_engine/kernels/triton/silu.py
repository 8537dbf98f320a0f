"""SiLU on the GPU: x / (1 + exp(-x)) in fp32, returned in x.dtype.

The elementwise template (`_elementwise.py`: one kernel, no argument
specialised, IEEE division) with this formula; backward: autograd through the
same formula in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.triton._common import SERVING, div_rn
from rl_engine.kernels.triton._elementwise import elementwise_function


@triton.jit
def silu_value(x, ACC: tl.constexpr):
    return div_rn(x, 1.0 + tl.exp(-x), ACC)


def silu_reference(x32: torch.Tensor) -> torch.Tensor:
    return x32 / (1.0 + torch.exp(-x32))


_InvariantSiLU = elementwise_function("silu", silu_value, silu_reference, __name__)
silu_forward = _InvariantSiLU.apply
silu = elementwise_op("silu", silu_forward, SERVING, __name__)
