"""Embedding lookup: a gather, so each token's row is its weight row, bit for bit.

Invariant by construction; the op (rl_engine/kernels/common/embedding.py) range-checks
every id with an error that names the bad values. Backward is torch's embedding
backward (deterministic on CPU).
"""

from __future__ import annotations

import torch.nn.functional as F

from rl_engine.kernels.common.embedding import embedding_op
from rl_engine.kernels.native._serving import PLAIN


def embedding_forward(ids, weight, padding_idx):
    return F.embedding(ids, weight, padding_idx=padding_idx)


embedding = embedding_op(embedding_forward, PLAIN, __name__)
