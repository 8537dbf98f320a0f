"""The `rms_norm` op, written once: HF semantics (fp32 statistics, normalised value cast back, * weight).

The backend supplies `rms_norm_forward(x, weight, eps)` (differentiable, any
leading dims, at least one element); the checks and the empty case are here.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_floating, check_last_dim
from rl_engine.kernels.common.op import Serving, define_op


def rms_norm_op(rms_norm_forward, serving: Serving, module: str):
    """The public `rms_norm` of the backend `module`."""

    def build(guard):
        def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            """x (..., H), weight (H,) -> (..., H) (HF LlamaRMSNorm semantics)."""
            check_floating("x", x)
            check_floating("weight", weight)
            check_last_dim("x", x, weight.shape[-1], "the norm weight's size")
            guard("x", x)
            if x.shape[-1] == 0 or x.numel() == 0:
                return x * weight
            return rms_norm_forward(x, weight, eps)

        return rms_norm

    return define_op("rms_norm", module, serving, build)
