"""Vocabulary projection on the GPU: hidden (..., H) @ W^T -> fp32 logits (..., V).

The same persistent fixed-order matmul as `linear`, stored without rounding
to the input dtype: logits never pass through a bf16 rounding of the full sum.
Tied weights work: `weight` may be the embedding matrix.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.triton.linear import apply_projection


def lm_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """hidden (..., H), weight (V, H) -> fp32 logits (..., V) (fp64 for fp64)."""
    return apply_projection(hidden, weight, bias, at_least_fp32(hidden.dtype))
