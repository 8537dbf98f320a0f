"""Mixture-of-experts experts on the GPU: each expert's rows through the fixed-order matmul and SiLU kernels.

The grouping by expert, the per-expert MLP on exactly its rows (no padding to
the batch), HF's scaling and ascending-expert combine (elementwise adds in a
fixed order: no `index_add_`, whose CUDA kernel uses atomics) and the backward
and the op are the backend-independent ones of rl_engine/kernels/common/moe_experts.py;
the projections are `triton.linear`'s (constant tiles, no split-K: a row's bits
do not depend on how many rows its expert received) and the activation
`triton.silu`'s. With `spans=` / `sink=`: the shared layout-invariant backward
(common/moe_experts_sequences.py) around `_matmul.exact_gemm`.
"""

from __future__ import annotations

from rl_engine.kernels.common.moe_experts import composed_forward, moe_experts_op
from rl_engine.kernels.triton._common import SERVING
from rl_engine.kernels.triton._matmul import exact_gemm
from rl_engine.kernels.triton.linear import PROJECTION
from rl_engine.kernels.triton.silu import silu_forward

experts_forward = composed_forward(PROJECTION, silu_forward)
moe_experts = moe_experts_op(experts_forward, silu_forward, SERVING, __name__, exact_gemm)
