"""Mixture-of-experts experts: grouped per expert, invariant GEMMs and SiLU, HF's combine order.

hidden (N, H), gate_up (E, 2I, H), down (E, H, I), indices / weights (N, k)
-> (N, H) in hidden's dtype. Hugging Face's default `grouped_mm` (and its
`eager` loop) run the experts through `torch._grouped_mm` / `F.linear`, whose
row results depend on how many rows an expert received; `grouped_mm` also
raises on CPU for 16-bit widths that are not a multiple of 8. Here each
expert's rows go through this backend's projection and silu, and the grouping,
scaling, combine, backward and the op are the backend-independent ones of
rl_engine/kernels/common/moe_experts.py (contract there).
"""

from __future__ import annotations

from rl_engine.kernels.common.moe_experts import composed_forward, moe_experts_op
from rl_engine.kernels.native._serving import GEMM
from rl_engine.kernels.native.linear import PROJECTION, exact_gemm
from rl_engine.kernels.native.silu import silu_forward

experts_forward = composed_forward(PROJECTION, silu_forward)
moe_experts = moe_experts_op(experts_forward, silu_forward, GEMM, __name__, exact_gemm)
