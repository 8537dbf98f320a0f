"""Log-softmax over the last dim in fp32, after dividing by the sampling temperature.

This is THE definition of a logprob shared by the rollout engine and the trainer:
logits.float() / temperature -> log_softmax. torch's last-dim log_softmax works
on one row at a time with an order set only by the row length, so rows are
batch-invariant; `/` is exact on both the SIMD and the scalar path.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32, check_floating, check_temperature


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> fp32 logprobs (..., V) of softmax(logits / temperature); fp64 stays fp64."""
    check_floating("logits", logits)
    temperature = check_temperature(temperature)
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dim (the vocabulary)")
    scaled = logits.to(at_least_fp32(logits.dtype))
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)
