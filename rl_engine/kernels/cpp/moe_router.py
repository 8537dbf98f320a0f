"""Mixture-of-experts router on CPU: logits through the fixed-order C++ GEMM, then the shared routing.

The logits are the cpp projection of `hidden` (one serial K chain per output, so
a token's logits have the same bits alone and in any batch); the fp32
softmax, the top-k with ties to the lowest expert index, the optional
renormalisation in slot order, the cast, the backward and the op are the
backend-independent ones of rl_engine/kernels/common/moe_router.py.
"""

from __future__ import annotations

from rl_engine.kernels.common.moe_router import moe_router_op
from rl_engine.kernels.cpp._serving import GEMM
from rl_engine.kernels.cpp.linear import PROJECTION

moe_router = moe_router_op(PROJECTION, GEMM, __name__)
