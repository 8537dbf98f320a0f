"""Mixture-of-experts experts: grouped per expert, invariant GEMMs and SiLU, HF's combine order.

hidden (N, H), gate_up (E, 2I, H), down (E, H, I), indices / weights (N, k)
-> (N, H) in hidden's dtype. Hugging Face's default `grouped_mm` (and its
`eager` loop) run the experts through `torch._grouped_mm` / `F.linear`, whose
row results depend on how many rows an expert received; `grouped_mm` also
raises on CPU for 16-bit widths that are not a multiple of 8. Here each
expert's rows go through this backend's `linear` and `silu`, and the grouping,
scaling, combine and backward are the backend-independent ones of
rl_engine/kernels/common/moe_experts.py (contract there).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.moe_experts import (
    composed_forward,
    experts_backward,  # noqa: F401  (the op's backward)
    invariant_experts_function,
    run_experts,
)
from rl_engine.kernels.native.linear import linear
from rl_engine.kernels.native.silu import silu

experts_forward = composed_forward(linear, silu)
_InvariantExperts = invariant_experts_function(experts_forward, silu, __name__)


def moe_experts(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """(N, H): each token's experts in ascending index, scaled by its weights and summed."""
    return run_experts(_InvariantExperts, experts_forward, hidden, gate_up, down, indices, weights)
