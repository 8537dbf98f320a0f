"""Mixture-of-experts experts on CPU: each expert's rows through the C++ GEMM and SiLU.

The grouping by expert, the per-expert MLP on exactly its rows (no padding),
HF's scaling and ascending-expert combine, and the backward are the
backend-independent ones of rl_engine/kernels/common/moe_experts.py; the
projections are `cpp.linear` (a row's bits do not depend on how many rows the
expert received) and the activation `cpp.silu`.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.moe_experts import (
    experts_backward,  # noqa: F401  (the op's backward)
    invariant_experts_function,
    run_experts,
)
from rl_engine.kernels.cpp.linear import linear
from rl_engine.kernels.cpp.silu import silu

_InvariantExperts = invariant_experts_function(linear, silu, __name__)


def moe_experts(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """(N, H): each token's experts in ascending index, scaled by its weights and summed."""
    return run_experts(_InvariantExperts, linear, silu, hidden, gate_up, down, indices, weights)
