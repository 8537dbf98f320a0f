"""Sigmoid on the GPU: 1 / (1 + exp(-x)) in fp32, returned in x.dtype (Qwen2-MoE's shared-expert gate).

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
def sigmoid_value(x, ACC: tl.constexpr):
    return div_rn(tl.full(x.shape, 1.0, ACC), 1.0 + tl.exp(-x), ACC)


@triton.jit(do_not_specialize=ELEMENTWISE_ARGS, do_not_specialize_on_alignment=ELEMENTWISE_ARGS)
def _sigmoid_kernel(x_ptr, out_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    elementwise_body(x_ptr, out_ptr, n, sigmoid_value, ACC, BLOCK)


def sigmoid_reference(x32: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x32))


_InvariantSigmoid = elementwise_function("sigmoid", _sigmoid_kernel, sigmoid_reference, __name__)
sigmoid_forward = _InvariantSigmoid.apply
sigmoid = elementwise_op("sigmoid", sigmoid_forward, SERVING, __name__)
