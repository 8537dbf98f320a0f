"""Batch-invariant causal attention (grouped-query) on CPU, one query row at a time.

Contract: the one of `rl_engine.kernels.native.attention` (same arguments,
shapes, layouts, padding and kv_index semantics, exact zeros for padding
queries, output in q.dtype, statistics in fp32).

Numerics (csrc/attention_impl.h, `attention_block`): every query row is computed
against the keys at positions 0..p of its sequence in an order that depends on
p and the head dim D only:
- scores: 16 keys per vector, one FMA per d in increasing d (q pre-scaled);
- the row max is exact; e = exp(s - max) with the kernels' own exp;
- the denominator: lane j mod 16 in increasing j, then the fixed hsum tree;
- p @ v: lanes over d, one FMA per key in increasing position; then / l.
Rows are grouped in blocks (up to 16 queries x the G heads of a kv group) only
to share key and value loads; nothing is tiled by shape, so a decode step, a
prefill row, a chunked-prefill row and any batch or thread count give the
same bits, and a decode query costs O(p * D) instead of a 16-row tile. Keys
past p never reach a row's result (their lanes are -inf before the max, and
p @ v stops at p), so garbage there, even inf or nan, cannot leak.

Backward: torch's SDPA backward on a recomputed forward (see
attention_backward): deterministic and accurate, not invariant (it need not be).
fp64 (gradcheck) and fp16 go through the native op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.kernels.common.attention import invariant_attention_function, run_attention
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.native.attention import attention as native_attention

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _aligned_keys(x: torch.Tensor, k_positions: torch.Tensor, length: int) -> torch.Tensor:
    """Keys or values by position: (B, Hkv, length, D) fp32, zero where no slot holds a position."""
    B, Hkv, _, D = x.shape
    out = torch.zeros((B, Hkv, length, D), dtype=torch.float32, device=x.device)
    kp = k_positions.long()
    sb, slot = ((kp >= 0) & (kp < length)).nonzero(as_tuple=True)
    out[sb, :, kp[sb, slot]] = x[sb, :, slot].float()  # (N, Hkv, D)
    return out


def attention_backward(grad_out, q, k, v, q_positions, k_positions, scale):
    """(dq, dk, dv) in fp32: torch's SDPA backward on the keys laid out by position.

    Gradients need not be batch-invariant, only accurate and deterministic, so
    the forward is recomputed with `F.scaled_dot_product_attention` (causal
    mask from the positions) and differentiated by autograd. Padding queries
    attend to key 0 (any finite row) with a zero output gradient, so they add
    exactly nothing; slots no query sees get zero gradients.
    """
    q_positions = q_positions.long()
    length = max(int(q_positions.max()) + 1, 1)  # positions any query sees
    B, Hkv, Tk, D = k.shape
    if k_positions is None:
        kk = torch.zeros((B, Hkv, length, D), dtype=torch.float32, device=k.device)
        vv = torch.zeros_like(kk)
        n = min(length, Tk)
        kk[:, :, :n], vv[:, :, :n] = k[:, :, :n], v[:, :, :n]
    else:
        kk, vv = _aligned_keys(k, k_positions, length), _aligned_keys(v, k_positions, length)
    live = q_positions >= 0  # (B, Tq)
    mask = torch.arange(length, device=q.device) <= q_positions[:, :, None]  # (B, Tq, L)
    mask[:, :, 0] |= ~live
    go = torch.where(live[:, None, :, None], grad_out.float(), 0.0)
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_(True) for t in (q, kk, vv)]
        out = F.scaled_dot_product_attention(
            *leaves, attn_mask=mask[:, None], scale=scale, enable_gqa=True
        )
        dq, dkk, dvv = torch.autograd.grad(out, leaves, go)
    dq = torch.where(live[:, None, :, None], dq, 0.0)
    if k_positions is None:
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        dk[:, :, :n], dv[:, :, :n] = dkk[:, :, :n], dvv[:, :, :n]
        return dq, dk, dv
    return dq, _back_to_slots(dkk, k_positions, Tk), _back_to_slots(dvv, k_positions, Tk)


def _back_to_slots(grad: torch.Tensor, k_positions: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, Hkv, L, D) by position -> (B, Hkv, slots, D) by slot; empty or unseen slots get 0."""
    B, Hkv, length, D = grad.shape
    out = torch.zeros((B, Hkv, slots, D), dtype=grad.dtype, device=grad.device)
    kp = k_positions.long()
    sb, slot = ((kp >= 0) & (kp < length)).nonzero(as_tuple=True)
    out[sb, :, slot] = grad[sb, :, kp[sb, slot]]
    return out


def _check_distinct_positions(q_positions: torch.Tensor) -> None:
    ordered = q_positions.sort(dim=1).values  # (B, Tq)
    if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
        raise ValueError("q_positions: a sequence has the same position twice")


def attention_forward(q, k, v, q_positions, k_positions, scale, kv_index):
    """fp32 (B, Hq, Tq, D): every valid query row through the fixed-order row kernel."""
    B = q.shape[0]
    q_positions = q_positions.long()
    if q_positions.shape[1] > 1:
        _check_distinct_positions(q_positions)
    if k_positions is not None:
        length = max(int(q_positions.max()) + 1, 1) if q_positions.numel() else 1
        k, v = _aligned_keys(k, k_positions, length), _aligned_keys(v, k_positions, length)
    elif q_positions.numel() and int(q_positions.max()) >= k.shape[2]:
        raise ValueError(
            f"q_positions: a query at position {int(q_positions.max())} needs that many keys "
            f"plus one, but k holds {k.shape[2]} (aligned layout: slot j = position j)"
        )
    rows = kv_index.long() if kv_index is not None else torch.arange(B, device=q.device)
    if k.dtype == v.dtype == torch.bfloat16:  # widened (exactly) while the kernel packs them
        k, v = k.contiguous(), v.contiguous()
    else:
        k, v = k.float().contiguous(), v.float().contiguous()
    q = q.contiguous() if q.dtype == torch.bfloat16 else q.float().contiguous()
    return extension().attention(q, k, v, q_positions, rows, scale, current_isa())


def _forward(q, k, v, q_positions, k_positions, scale, kv_index):
    if q.numel() == 0:
        return q.new_zeros(q.shape)
    if q.shape[-1] > 256:
        raise ValueError(f"q has head dim {q.shape[-1]}; the cpp backend supports up to 256")
    return attention_forward(q, k, v, q_positions, k_positions, scale, kv_index).to(q.dtype)


_InvariantAttention = invariant_attention_function(_forward, __name__, backward=attention_backward)


def attention(q, k, v, *, q_positions, k_positions=None, scale=None, kv_index=None) -> torch.Tensor:
    """Batch-invariant causal GQA attention; the contract of the native op.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D); q_positions: (B, Tq) int;
    k_positions: (B, Tk) int or None (aligned KV-cache layout); kv_index: (B,)
    int or None (rows of (S, Hkv, Tk, D) caches). Returns (B, Hq, Tq, D) in q.dtype.
    """
    if q.dtype not in KERNEL_DTYPES or q.device.type != "cpu":
        return native_attention(
            q,
            k,
            v,
            q_positions=q_positions,
            k_positions=k_positions,
            scale=scale,
            kv_index=kv_index,
        )
    return run_attention(_InvariantAttention, q, k, v, q_positions, k_positions, scale, kv_index)
