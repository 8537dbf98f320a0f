"""Log-softmax over the last dim in fp32, after dividing by the sampling temperature.

This is THE definition of a logprob shared by the rollout engine and the trainer:
logits.float() / temperature -> log_softmax. torch's last-dim log_softmax works
on one row at a time with an order set only by the row length, so rows are
batch-invariant; `/` is exact on both the SIMD and the scalar path.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.log_softmax import log_softmax_op
from rl_engine.kernels.native._serving import PLAIN


def log_softmax_forward(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (..., V) -> logprobs (..., V) in fp32 (fp64 for fp64); temperature already checked."""
    scaled = logits.to(at_least_fp32(logits.dtype))
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


log_softmax = log_softmax_op(log_softmax_forward, PLAIN, __name__)
