"""Mixture-of-experts router: invariant logits, fp32 softmax, top-k with ties to the lowest index.

hidden (..., H) and the router weight (E, H) -> (logits (N, E) in hidden's
dtype, weights (N, k), indices (N, k) int64), the tuple a Hugging Face
`*TopKRouter` returns. HF computes the logits with `F.linear` (not
row-invariant on this CPU: its kernel depends on the number of rows) and picks
the experts with `torch.topk` (whose order of equal values is unspecified).
Here the logits come from this backend's `linear` (`_gemm.fixed_order_matmul`)
and the rest is the backend-independent routing of
rl_engine/kernels/common/moe_router.py (contract and backward there).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.moe_router import route_tokens, routing_backward  # noqa: F401
from rl_engine.kernels.native.linear import linear


def moe_router(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = False,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits (N, E), weights (N, k) in weights_dtype or the logits' dtype, indices (N, k))."""
    return route_tokens(
        linear, hidden, weight, top_k, renormalize=renormalize, weights_dtype=weights_dtype
    )
