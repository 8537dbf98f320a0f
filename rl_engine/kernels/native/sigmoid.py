"""Sigmoid computed as 1 / (1 + exp(-x)) in fp32 (Qwen2-MoE's shared-expert gate).

torch's own `torch.sigmoid` runs the tail of every elementwise loop through
scalar code whose fp32 bits differ from the SIMD body (measured on this CPU:
90 of 2000 values differ between a one-element call and a long one), and which
elements fall in the tail depends on the tensor size and the thread split.
`exp`, `+` and `/` give the same bits on both paths (the fact the `silu` op
rests on), so this formulation is position- and thread-invariant.
Backward: autograd through the same ops.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.native._serving import PLAIN


def sigmoid_forward(x: torch.Tensor) -> torch.Tensor:
    x32 = x.to(at_least_fp32(x.dtype))
    if torch.is_grad_enabled() and x.requires_grad:
        return (1.0 / (1.0 + torch.exp(-x32))).to(x.dtype)
    # No autograd (rollout decode): one buffer, same ops, same bits.
    denom = torch.neg(x32).exp_().add_(1.0)
    return torch.reciprocal(denom, out=denom).to(x.dtype)


sigmoid = elementwise_op("sigmoid", sigmoid_forward, PLAIN, __name__)
