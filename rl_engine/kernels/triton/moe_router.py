"""Mixture-of-experts router on the GPU: logits through the fixed-order matmul, routing in one program per row.

The logits are the triton projection of `hidden` (constant tiles, no split-K).
Then one program per token reads its E logits into one BLOCK-wide fp32 vector
(BLOCK = next power of two of E: the order of every reduction depends on E
alone), takes the softmax (exact max, one tree sum), and picks the top k in k
rounds: the largest remaining probability, and of equal ones the LOWEST expert
index (a min over the indices holding the max), which is then struck out. The
chosen values are summed in slot order (slot 0 first) for the optional
renormalisation and cast to the weights' dtype. The softmax's bits are this
backend's own (not torch's); the tie rule and the orders are the contract of
rl_engine/kernels/common/moe_router.py, whose plain backward and op this backend shares.

The routing kernel specialises no pointer or integer argument (one binary for
every token count, offset and view), and divides with IEEE rounding (`div_rn`);
its exp is the hardware's approximation, like log_softmax's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.moe_router import moe_router_op
from rl_engine.kernels.triton._common import SERVING, check_device, div_rn, tl_dtype
from rl_engine.kernels.triton._launch import FP_FUSION, Launch
from rl_engine.kernels.triton.linear import PROJECTION

MAX_EXPERTS = 8192  # one row in one block


_ARGS = ["logits_ptr", "weights_ptr", "indices_ptr", "probs_ptr", "total_ptr", "E", "stride_l"]


@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _route_kernel(
    logits_ptr,
    weights_ptr,
    indices_ptr,
    probs_ptr,
    total_ptr,
    E,
    stride_l,
    ACC: tl.constexpr,
    TOP_K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=live, other=float("-inf")).to(ACC)
    e = tl.where(live, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = div_rn(e, tl.sum(e, axis=0), ACC)
    tl.store(probs_ptr + row * E + offs, p, mask=live)
    slots = tl.arange(0, K_BLOCK)
    values = tl.zeros((K_BLOCK,), dtype=ACC)
    picks = tl.zeros((K_BLOCK,), dtype=tl.int64)
    free = live
    total = tl.sum(values, axis=0)  # 0 in ACC
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, p, -1.0), axis=0)
        pick = tl.min(tl.where(free & (p == best), offs, BLOCK), axis=0)
        first_free = tl.min(tl.where(free, offs, BLOCK), axis=0)
        pick = tl.where(pick < BLOCK, pick, first_free)  # a NaN row: take the lowest free index
        value = tl.sum(tl.where(offs == pick, p, 0.0), axis=0)
        values = tl.where(slots == j, value, values)
        picks = tl.where(slots == j, pick.to(tl.int64), picks)
        total = total + value  # slot order: ((v0 + v1) + v2) + ...
        free = free & (offs != pick)
    if RENORM:
        values = div_rn(values, total, ACC)
    kmask = slots < TOP_K
    tl.store(total_ptr + row, total)
    tl.store(weights_ptr + row * TOP_K + slots, values.to(weights_ptr.dtype.element_ty), mask=kmask)
    tl.store(indices_ptr + row * TOP_K + slots, picks, mask=kmask)


def route_forward(logits, top_k, renormalize, weights_dtype):
    """(weights (N, k), indices (N, k), probs (N, E), total (N, 1) or None), one program per row."""
    check_device("router logits", logits)
    logits = logits.contiguous()
    rows, experts = logits.shape
    if experts > MAX_EXPERTS:
        raise ValueError(f"the triton router takes at most {MAX_EXPERTS} experts, got {experts}")
    acc = at_least_fp32(logits.dtype)
    weights = torch.empty((rows, top_k), dtype=weights_dtype, device=logits.device)
    indices = torch.empty((rows, top_k), dtype=torch.long, device=logits.device)
    probs = torch.empty((rows, experts), dtype=acc, device=logits.device)
    total = torch.empty((rows, 1), dtype=acc, device=logits.device)
    if rows:
        route_launch(logits, weights, indices, probs, total, top_k, renormalize).run()
    return weights, indices, probs, total if renormalize else None


def route_launch(logits, weights, indices, probs, total, top_k, renormalize) -> Launch:
    """The launch that routes each row of logits (N, E): softmax, top k, optional renormalisation."""
    rows, experts = logits.shape
    renorm = bool(renormalize)
    return Launch(
        variant=f"route_e{triton.next_power_of_2(experts)}_top{top_k}"
        + ("_renorm" if renorm else ""),
        kernel=_route_kernel,
        grid=(rows,),
        args=(logits, weights, indices, probs, total, experts, logits.stride(0)),
        constexprs=dict(
            ACC=tl_dtype(probs.dtype),
            TOP_K=top_k,
            K_BLOCK=triton.next_power_of_2(top_k),
            RENORM=renorm,
            BLOCK=triton.next_power_of_2(experts),
        ),
        num_warps=4,
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


moe_router = moe_router_op(PROJECTION, SERVING, __name__, route=route_forward)
