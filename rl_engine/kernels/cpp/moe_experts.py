"""Mixture-of-experts experts on CPU: one C++ call runs every expert through the GEMM and SiLU kernels.

The grouping by expert (Python: a few torch calls per op call, none per
expert) is the backend-independent one of rl_engine/kernels/common/moe_experts.py;
`csrc/moe_impl.h` then runs each expert's rows through the fixed-order GEMM
(the serial K chain of `cpp.linear`: a row's bits do not depend on how many
rows its expert received), the silu kernel and one rounded product, scales
the rows by their routing weights and adds each token's rows in ascending
expert index, with the bits of the plain composition of `cpp.linear` and
`cpp.silu` (tests compare the two, and HF's eager loop run on them). Threads
split the GEMMs' output blocks of all experts at once, never a reduction.
fp64 / fp16 (opt-in only: the GEMM is not invariant there) go through that
composition. Backward and the op: the common ones.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.moe_experts import composed_forward, group_by_expert, moe_experts_op
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp._serving import GEMM, KERNEL_DTYPES
from rl_engine.kernels.cpp.linear import PROJECTION, exact_gemm
from rl_engine.kernels.cpp.silu import silu_forward

_composed = composed_forward(PROJECTION, silu_forward)


def experts_forward(hidden, gate_up, down, indices, weights, keep: bool):
    """(out (N, H), saved for the backward or None); see `composed_forward` for the contract."""
    if hidden.dtype not in KERNEL_DTYPES:
        return _composed(hidden, gate_up, down, indices, weights, keep)
    grouping = group_by_expert(indices, gate_up.shape[0])
    spans = torch.tensor(grouping.spans, dtype=torch.long).reshape(-1, 3)  # (G, 3)
    pair_weights = weights.t().reshape(-1)[grouping.order]  # (S,)
    outs = extension().moe_experts(
        hidden.contiguous(),
        gate_up.contiguous(),
        down.contiguous(),
        grouping.tokens,
        spans,
        pair_weights,
        grouping.combine_rows,
        current_isa(),
        keep,
    )
    return outs[0], ((grouping, outs[1], outs[2]) if keep else None)


moe_experts = moe_experts_op(experts_forward, silu_forward, GEMM, __name__, exact_gemm)
