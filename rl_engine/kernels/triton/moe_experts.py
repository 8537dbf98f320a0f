"""Mixture-of-experts experts on the GPU: each expert's rows through the fixed-order matmul and SiLU kernels.

The grouping by expert, the per-expert MLP on exactly its rows (no padding to
the batch), HF's scaling and ascending-expert combine (elementwise adds in a
fixed order: no `index_add_`, whose CUDA kernel uses atomics) and the backward
are the backend-independent ones of rl_engine/kernels/common/moe_experts.py;
the projections are `triton.linear` (constant tiles, no split-K: a row's bits
do not depend on how many rows its expert received) and the activation
`triton.silu`.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.moe_experts import (
    composed_forward,
    experts_backward,  # noqa: F401  (the op's backward)
    invariant_experts_function,
    run_experts,
)
from rl_engine.kernels.triton._common import check_device
from rl_engine.kernels.triton.linear import linear
from rl_engine.kernels.triton.silu import silu

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
    check_device("hidden", hidden)
    return run_experts(_InvariantExperts, experts_forward, hidden, gate_up, down, indices, weights)
