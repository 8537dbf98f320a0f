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


def add_embedding_grad_(
    grad_weight: torch.Tensor,
    ids: torch.Tensor,
    grad_out: torch.Tensor,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """`grad_weight` += the embedding's weight gradient for `ids` (...) and the gradient of its
    output `grad_out` (..., H), in place; returns grad_weight.

    Bit for bit what autograd's sum of the two gives (`grad_weight + embedding_dense_backward`,
    as for a weight tied to an LM head), without the dense V x H gradient: the rows of the ids
    that occur are summed by torch's own `embedding_dense_backward` on a table of those rows
    (each row over its tokens in order, as on the full table), then added once; every other
    row adds +0.
    """
    flat = ids.reshape(-1)
    rows, inverse = torch.unique(flat, return_inverse=True)
    pad = -1  # torch's "no padding row"
    if padding_idx is not None:
        hit = (rows == padding_idx).nonzero()
        pad = int(hit[0, 0]) if hit.numel() else -1
    grad2d = grad_out.reshape(flat.numel(), grad_out.shape[-1])
    sums = torch.ops.aten.embedding_dense_backward(grad2d, inverse, rows.numel(), pad, False)
    grad_weight.add_(0.0)  # the rows no id touches: x + 0 (-0.0 becomes +0.0, as in the sum)
    grad_weight[rows] = grad_weight[rows] + sums
    return grad_weight
