"""The `log_softmax` op, written once: THE logprob, log_softmax(logits / temperature) in fp32.

The backend supplies `log_softmax_forward(logits, temperature)` (differentiable, any
leading dims; fp32 logprobs, fp64 for fp64); the checks are here.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_floating, check_temperature
from rl_engine.kernels.common.op import Serving, define_op


def log_softmax_op(log_softmax_forward, serving: Serving, module: str):
    """The public `log_softmax` of the backend `module`."""

    def build(guard):
        def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
            """logits (..., V) -> fp32 logprobs (..., V) of softmax(logits / temperature); fp64
            stays fp64."""
            check_floating("logits", logits)
            temperature = check_temperature(temperature)
            if logits.dim() == 0:
                raise ValueError("logits must have at least one dim (the vocabulary)")
            guard("logits", logits)
            return log_softmax_forward(logits, temperature)

        return log_softmax

    return define_op("log_softmax", module, serving, build)
