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

Packed rows (q_segments / k_segments): the C++ kernel takes *runs*, each a
stretch of consecutive queries of one sequence and the slot of that sequence's
position 0 in a kv row (`_packed_layout`). Keys stay where they are when each
sequence's positions 0..n-1 sit in consecutive slots (a packed row); otherwise
they are first scattered to one aligned row per sequence. Either way a row's
keys are packed from its sequence's position 0, so its bits are those of the
same query in a padded row or a decode step.

Backward: torch's SDPA backward on a recomputed forward, one sequence at a
time in a call of its own (`sequence_backward`): accurate, and a sequence's
gradients do not depend on the other sequences, the padding or the packing
(tests/kernels/test_sequence_backward.py), which layout-invariant training needs. fp64 (gradcheck) and fp16 run the native forward and the shared backward
(row-invariant as native is: where native's platform probe refuses the dtype, this op
raises PlatformInvarianceError for it too, `cpp/_serving.py: ATTENTION`). The op's signature and checks are the shared ones
(rl_engine/kernels/common/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl_engine.kernels.common.attention import attention_backward as plain_attention_backward
from rl_engine.kernels.common.attention import attention_op
from rl_engine.kernels.common.segments import (
    Sequences,
    check_distinct_positions,
    sequence_lengths,
    sequences_of,
)
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp._serving import ATTENTION, KERNEL_DTYPES
from rl_engine.kernels.native.attention import attention_forward as native_attention_forward


def _aligned_keys(x: torch.Tensor, k_positions: torch.Tensor, length: int) -> torch.Tensor:
    """Keys or values by position: (B, Hkv, length, D) fp32, zero where no slot holds a position."""
    B, Hkv, _, D = x.shape
    out = torch.zeros((B, Hkv, length, D), dtype=torch.float32, device=x.device)
    kp = k_positions.long()
    sb, slot = ((kp >= 0) & (kp < length)).nonzero(as_tuple=True)
    out[sb, :, kp[sb, slot]] = x[sb, :, slot].float()  # (N, Hkv, D)
    return out


def attention_backward(
    grad_out, q, k, v, q_positions, k_positions, scale, q_segments=None, k_segments=None
):
    """(dq, dk, dv) in fp32: SDPA's backward, every sequence alone (`sequence_backward`).

    A padded row is one sequence (its keys by slot = position when k_positions is None);
    packed rows hold several (segments). Padding queries and slots no query sees get 0.
    """
    if q_segments is not None:
        layout = _packed_layout(q_positions, q_segments, k_positions, k_segments)
        return sequence_backward(grad_out, q, k, v, q_positions, k_positions, scale, layout.seqs)
    B, Tk = k.shape[0], k.shape[2]
    if k_positions is None:  # aligned: slot j holds position j
        k_positions = torch.arange(Tk, device=k.device).expand(B, Tk)
    q_rows = torch.zeros_like(q_positions)
    k_rows = torch.zeros_like(k_positions)
    seqs = sequences_of(q_positions, q_rows, k_positions, k_rows)
    return sequence_backward(grad_out, q, k, v, q_positions, k_positions, scale, seqs)


def _check_distinct_positions(q_positions: torch.Tensor) -> None:
    ordered = q_positions.sort(dim=1).values  # (B, Tq)
    if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
        raise ValueError("q_positions: a sequence has the same position twice")


def attention_forward(
    q, k, v, q_positions, k_positions, scale, kv_index, q_segments=None, k_segments=None
):
    """fp32 (B, Hq, Tq, D): every valid query row through the fixed-order row kernel."""
    q_positions = q_positions.long()
    if q_segments is not None:
        return _packed_forward(q, k, v, q_positions, k_positions, q_segments, k_segments, scale)
    if q_positions.shape[1] > 1:
        _check_distinct_positions(q_positions)
    if kv_index is not None and kv_index.dim() == 2:
        return _paged_forward(q, k, v, q_positions, kv_index, scale)
    if k_positions is not None:
        length = max(int(q_positions.max()) + 1, 1) if q_positions.numel() else 1
        k, v = _aligned_keys(k, k_positions, length), _aligned_keys(v, k_positions, length)
    elif q_positions.numel() and int(q_positions.max()) >= k.shape[2]:
        raise ValueError(
            f"q_positions: a query at position {int(q_positions.max())} needs that many keys "
            f"plus one, but k holds {k.shape[2]} (aligned layout: slot j = position j)"
        )
    rows = kv_index.long() if kv_index is not None else torch.arange(q.shape[0], device=q.device)
    return _run_kernel(q, k, v, q_positions, rows, scale)


def _packed_forward(q, k, v, q_positions, k_positions, q_segments, k_segments, scale):
    """Packed rows: the kernel's runs, keys in place or first laid out per sequence."""
    layout = _packed_layout(q_positions, q_segments, k_positions, k_segments)
    if layout.seqs.count == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if not layout.in_place:
        k, v = (_keys_by_sequence(t, k_positions, layout) for t in (k, v))
    rows = torch.zeros(0, dtype=torch.long, device=q.device)  # the runs name the kv rows
    return _run_kernel(q, k, v, q_positions, rows, scale, layout.runs)


def _paged_forward(q, k, v, q_positions, block_table, scale):
    """Keys read in place from a paged cache: row b's position j is k[block_table[b, j //
    block], :, j % block] (k, v: (blocks, Hkv, block, D) views, rows of D contiguous, such
    as vLLM's CPU cache halves). The kernel packs them into the 16-key blocks the aligned
    path packs (block % 16 == 0), so the bits are those of the gathered keys."""
    if k.dtype != v.dtype or k.dtype not in KERNEL_DTYPES:
        raise ValueError(f"paged k, v must share fp32 or bf16, got k={k.dtype}, v={v.dtype}")
    block = k.shape[2]
    if block % 16 or k.stride(3) != 1 or k.stride(2) != k.shape[3] or k.stride() != v.stride():
        raise ValueError(
            f"paged k, v of shape {list(k.shape)} and strides {k.stride()}, {v.stride()}: the "
            "kernel reads blocks of a multiple of 16 positions with rows of D contiguous"
        )
    q = q.contiguous() if q.dtype == torch.bfloat16 else q.float().contiguous()
    rows = torch.zeros(0, dtype=torch.long, device=q.device)
    table = block_table.long().contiguous()
    return extension().attention(q, k, v, q_positions, rows, scale, current_isa(), None, table)


def _run_kernel(q, k, v, q_positions, rows, scale, runs=None):
    """The C++ kernel on contiguous fp32 or bf16 inputs (bf16 widened exactly inside it)."""
    if k.dtype == v.dtype == torch.bfloat16:  # widened (exactly) while the kernel packs them
        k, v = k.contiguous(), v.contiguous()
    else:
        k, v = k.float().contiguous(), v.float().contiguous()
    q = q.contiguous() if q.dtype == torch.bfloat16 else q.float().contiguous()
    return extension().attention(q, k, v, q_positions, rows, scale, current_isa(), runs)


# ----------------------------------------------------------------------------- packed rows


@dataclass(frozen=True)
class PackedLayout:
    """How the kernel reads one packed call: its sequences and runs (see `_packed_layout`)."""

    seqs: Sequences
    lengths: torch.Tensor
    """(count,) int64: positions each sequence's queries see."""
    runs: torch.Tensor
    """(n, 5) int64: (q row, first column, count, kv row, slot of position 0) per run."""
    in_place: bool
    """Each sequence's keys 0..length-1 sit in consecutive slots of its row (read there);
    else the kv row of a run is its sequence in `_keys_by_sequence`'s copy."""


_LAST_LAYOUT: list = [None, None]  # (a stamp of each of the four tensors, PackedLayout)


def _stamp(t: torch.Tensor):
    """What tells that `t` is unchanged: its version counter, or for an inference tensor
    (which has none) a copy of its values."""
    return t.clone() if t.is_inference() else t._version


def _unchanged(t: torch.Tensor, entry) -> bool:
    held, stamp = entry
    if t is not held:
        return False
    return torch.equal(t, stamp) if t.is_inference() else t._version == stamp


def _packed_layout(q_positions, q_segments, k_positions, k_segments) -> PackedLayout:
    """The runs of a packed call, computed once for the same four tensors (every layer of a
    forward and its backward pass the same ones): same objects, unchanged (`_unchanged`)."""
    tensors = (q_positions, q_segments, k_positions, k_segments)
    key, cached = _LAST_LAYOUT
    if key is not None and all(_unchanged(t, entry) for t, entry in zip(tensors, key)):
        return cached
    layout = _build_packed_layout(*tensors)
    _LAST_LAYOUT[:] = [tuple((t, _stamp(t)) for t in tensors), layout]
    return layout


def _build_packed_layout(q_positions, q_segments, k_positions, k_segments) -> PackedLayout:
    """Runs = maximal stretches of consecutive columns of one row whose queries belong to one
    sequence; in place when every sequence's key slot minus key position is one constant s0
    and all of its positions 0..length-1 are there."""
    q_positions, k_positions = q_positions.long(), k_positions.long()
    seqs = sequences_of(q_positions, q_segments, k_positions, k_segments)
    lengths = sequence_lengths(q_positions, seqs)
    if seqs.count == 0:
        return PackedLayout(seqs, lengths, torch.zeros((0, 5), dtype=torch.long), True)
    check_distinct_positions(q_positions, seqs)
    qb, qt = (seqs.q_seq >= 0).nonzero(as_tuple=True)  # row-major order
    sid = seqs.q_seq[qb, qt]
    start = torch.ones_like(qb, dtype=torch.bool)
    start[1:] = (qb[1:] != qb[:-1]) | (qt[1:] != qt[:-1] + 1) | (sid[1:] != sid[:-1])
    first = start.nonzero().squeeze(1)
    counts = torch.diff(first, append=first.new_tensor([qb.numel()]))
    run_seq = sid[first]
    kb, kt = (seqs.k_seq >= 0).nonzero(as_tuple=True)
    kseq, kpos = seqs.k_seq[kb, kt], k_positions[kb, kt]
    seen = kpos < lengths[kseq]  # key slots some query of their sequence reads
    kseq, kpos, offset = kseq[seen], kpos[seen], (kt - k_positions[kb, kt])[seen]
    lo = torch.full((seqs.count,), torch.iinfo(torch.long).max).scatter_reduce_(
        0, kseq, offset, "amin"
    )
    hi = torch.full((seqs.count,), -1, dtype=torch.long).scatter_reduce_(0, kseq, offset, "amax")
    present = torch.bincount(kseq, minlength=seqs.count)
    in_place = bool(((lo == hi) & (present == lengths)).all())
    kv_row, slot0 = (seqs.row[run_seq], lo[run_seq]) if in_place else (run_seq, 0 * run_seq)
    runs = torch.stack([qb[first], qt[first], counts, kv_row, slot0], 1)
    return PackedLayout(seqs, lengths, runs, in_place)


def _keys_by_sequence(x: torch.Tensor, k_positions, layout: PackedLayout) -> torch.Tensor:
    """(count, Hkv, L, D): each sequence's keys (or values) at slot = position; missing ones 0."""
    seqs = layout.seqs
    kb, kt = (seqs.k_seq >= 0).nonzero(as_tuple=True)
    kseq, kpos = seqs.k_seq[kb, kt], k_positions.long()[kb, kt]
    return _by_position(x, kb, kt, kseq, kpos, int(layout.lengths.max()), seqs.count)


def _by_position(x, rows, cols, seq, pos, L: int, count: int) -> torch.Tensor:
    """Entries (rows, cols) of x (B, H, T, D) moved to (count, H, L, D) at (seq, pos); the rest 0.

    Entries at pos >= L are dropped."""
    out = torch.zeros((count, x.shape[1], L, x.shape[3]), dtype=x.dtype, device=x.device)
    keep = pos < L
    out.permute(0, 2, 1, 3)[seq[keep], pos[keep]] = x.permute(0, 2, 1, 3)[rows[keep], cols[keep]]
    return out


def sequence_backward(grad_out, q, k, v, q_positions, k_positions, scale, seqs: Sequences):
    """(dq, dk, dv) in fp32: SDPA's backward, one sequence at a time.

    Each sequence's queries, keys and values are laid out by position in fresh
    (1, H, L, D) fp32 tensors, L = its largest query position + 1, so plain causal
    attention (`is_causal`) is exactly its own attention, and the call (shapes, values,
    memory layout) is the same whatever else shared the batch, the padding or the
    packing: a sequence's gradients are a function of the sequence alone (layout-
    invariant training needs that). A position no query holds is a zero row with a zero
    output gradient: it adds nothing.
    """
    q_positions, k_positions = q_positions.long(), k_positions.long()
    lengths = sequence_lengths(q_positions, seqs)
    qb, qt = (seqs.q_seq >= 0).nonzero(as_tuple=True)
    qseq, qpos = seqs.q_seq[qb, qt], q_positions[qb, qt]
    kb, kt = (seqs.k_seq >= 0).nonzero(as_tuple=True)
    kseq, kpos = seqs.k_seq[kb, kt], k_positions[kb, kt]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    q32, k32, v32, go32 = (t.detach().float() for t in (q, k, v, grad_out))
    for seq in range(seqs.count):
        L = int(lengths[seq])
        qsel, ksel = (qseq == seq).nonzero().squeeze(1), (kseq == seq).nonzero().squeeze(1)
        qi = (qb[qsel], qt[qsel], torch.zeros_like(qsel), qpos[qsel])
        ki = (kb[ksel], kt[ksel], torch.zeros_like(ksel), kpos[ksel])
        with torch.enable_grad():
            leaves = [
                _by_position(t, *idx, L, 1).requires_grad_(True)
                for t, idx in ((q32, qi), (k32, ki), (v32, ki))
            ]
            out = F.scaled_dot_product_attention(
                *leaves, is_causal=True, scale=scale, enable_gqa=True
            )
            go = _by_position(go32, *qi, L, 1)
            gq, gk, gv = torch.autograd.grad(out, leaves, go)
        rows, cols, zero, pos = qi
        dq.permute(0, 2, 1, 3)[rows, cols] = gq.permute(0, 2, 1, 3)[zero, pos]
        rows, cols, zero, pos = ki
        keep = pos < L
        rows, cols, zero, pos = rows[keep], cols[keep], zero[keep], pos[keep]
        dk.permute(0, 2, 1, 3)[rows, cols] = gk.permute(0, 2, 1, 3)[zero, pos]
        dv.permute(0, 2, 1, 3)[rows, cols] = gv.permute(0, 2, 1, 3)[zero, pos]
    return dq, dk, dv


# ----------------------------------------------------------------------------- the op


def _forward(q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments):
    """(B, Hq, Tq, D) in q.dtype: the C++ kernel for fp32 / bf16, native's forward otherwise."""
    if q.dtype not in KERNEL_DTYPES:
        return native_attention_forward(
            q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments
        )
    if q.numel() == 0:
        return q.new_zeros(q.shape)
    if q.shape[-1] > 256:
        raise ValueError(f"q has head dim {q.shape[-1]}; the cpp backend supports up to 256")
    out = attention_forward(
        q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments
    )
    return out.to(q.dtype)


def _backward(grad_out, q, k, v, q_positions, k_positions, scale, q_segments, k_segments):
    """SDPA's backward for the kernel's dtypes, the shared chunked one for native's."""
    backward = attention_backward if q.dtype in KERNEL_DTYPES else plain_attention_backward
    return backward(grad_out, q, k, v, q_positions, k_positions, scale, q_segments, k_segments)


attention = attention_op(_forward, ATTENTION, __name__, backward=_backward)
