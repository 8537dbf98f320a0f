"""Embedding lookup: a gather, so each token's row is its weight row, bit for bit.

Invariant by construction; the op exists so that every id is range-checked with
an error that names the bad values (torch's own message is an index error deep
inside the gather). Backward is torch's embedding backward (deterministic on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.kernels.common.checks import check_embedding


def embedding(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    """ids (...) int, weight (V, H) -> (..., H) in weight.dtype."""
    check_embedding(ids, weight)
    return F.embedding(ids, weight, padding_idx=padding_idx)
