"""SiLU computed as x / (1 + exp(-x)) in fp32.

torch's own `F.silu` / `sigmoid` compute the tail of every elementwise loop with
scalar code and the body with SIMD code, and on this CPU the two disagree in the
last bit for about 4% of fp32 inputs; which elements fall in the tail depends on
the tensor size and the thread split. `exp`, `+` and `/` give the same bits on
both paths, so this formulation is position- and thread-invariant.
Backward: autograd through the same ops.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.native._serving import PLAIN


def silu_forward(x: torch.Tensor) -> torch.Tensor:
    x32 = x.to(at_least_fp32(x.dtype))
    if torch.is_grad_enabled() and x.requires_grad:
        return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)
    # No autograd (rollout decode): one buffer, same ops, same bits.
    denom = torch.neg(x32).exp_().add_(1.0)
    return torch.div(x32, denom, out=denom).to(x.dtype)


silu = elementwise_op("silu", silu_forward, PLAIN, __name__)
