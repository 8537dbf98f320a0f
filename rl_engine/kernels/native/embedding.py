"""Embedding lookup: a gather, so each token's row is its weight row, bit for bit.

Invariant by construction; the op exists so that every id is range-checked with
an error that names the bad values (torch's own message is an index error deep
inside the gather). Backward is torch's embedding backward (deterministic on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.kernels.native._checks import check_floating, check_index_range


def embedding(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    """ids (...) int, weight (V, H) -> (..., H) in weight.dtype."""
    check_floating("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"embedding weight must be 2-D (vocab, hidden), got {tuple(weight.shape)}")
    check_index_range("token ids", ids, weight.shape[0], "the vocabulary size")
    return F.embedding(ids, weight, padding_idx=padding_idx)


class InvariantEmbedding(torch.nn.Module):
    """Drop-in for `nn.Embedding` that reuses the original Parameter object."""

    def __init__(self, base: torch.nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx = base.padding_idx
        self.weight = base.weight
        self._scale = getattr(base, "embed_scale", None)  # scaled embeddings (e.g. Gemma-style)

    def forward(self, ids):
        out = embedding(ids, self.weight, self.padding_idx)
        if self._scale is not None:
            out = out * self._scale.to(out.dtype)
        return out

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, batch_invariant=True"
