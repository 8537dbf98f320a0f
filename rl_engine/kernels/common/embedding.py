"""The `embedding` op, written once: ids (...) and weight (V, H) -> the weight rows, range-checked.

Invariant by construction (a gather: each token's row is its weight row, bit for
bit); the op exists so that every id is range-checked with an error that names
the bad values (torch's own message is an index error deep inside the gather).
The backend supplies `embedding_forward(ids, weight, padding_idx)` (differentiable).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_embedding
from rl_engine.kernels.common.op import Serving, define_op


def embedding_op(embedding_forward, serving: Serving, module: str):
    """The public `embedding` of the backend `module`."""

    def build(guard):
        def embedding(
            ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None
        ) -> torch.Tensor:
            """ids (...) int, weight (V, H) -> (..., H) in weight.dtype."""
            check_embedding(ids, weight)
            guard("weight", weight)
            return embedding_forward(ids, weight, padding_idx)

        return embedding

    return define_op("embedding", module, serving, build)
