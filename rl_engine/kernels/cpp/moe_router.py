"""Mixture-of-experts router on CPU: logits through the fixed-order C++ GEMM, then the shared routing.

The logits are `cpp.linear(hidden, weight)` (one serial K chain per output, so
a token's logits have the same bits alone and in any batch); the fp32
softmax, the top-k with ties to the lowest expert index, the optional
renormalisation in slot order, the cast and the backward are the
backend-independent ones of rl_engine/kernels/common/moe_router.py.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.moe_router import route_tokens, routing_backward  # noqa: F401
from rl_engine.kernels.cpp.linear import linear


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
