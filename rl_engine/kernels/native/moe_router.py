"""Mixture-of-experts router: invariant logits, fp32 softmax, top-k with ties to the lowest index.

hidden (..., H) and the router weight (E, H) -> (logits (N, E) in hidden's
dtype, weights (N, k), indices (N, k) int64), the tuple a Hugging Face
`*TopKRouter` returns. HF computes the logits with `F.linear` (not
row-invariant on this CPU: its kernel depends on the number of rows) and picks
the experts with `torch.topk` (whose order of equal values is unspecified).
Here the logits come from this backend's projection (`native.linear`) and the
rest is the backend-independent op of rl_engine/kernels/common/moe_router.py
(contract and backward there).
"""

from __future__ import annotations

from rl_engine.kernels.common.moe_router import moe_router_op
from rl_engine.kernels.native._serving import GEMM
from rl_engine.kernels.native.linear import PROJECTION

moe_router = moe_router_op(PROJECTION, GEMM, __name__)
