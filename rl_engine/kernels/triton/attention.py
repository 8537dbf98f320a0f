"""Batch-invariant causal attention (grouped-query) on the GPU, in two Triton kernels.

Contract: the native op's (rl_engine/kernels/native/attention.py, docs/ops/attention.md):
``attention(q, k, v, *, q_positions, k_positions=None, scale=None, kv_index=None,
q_segments=None, k_segments=None)`` with q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) (or (S, Hkv, Tk, D) caches read
through kv_index), per-query positions (negative = padding query, output row
exactly 0), k_positions or the aligned layout (slot j = position j), causal,
GQA (query head h reads kv head h // (Hq // Hkv)). fp32 statistics and
accumulation; output in q.dtype.

Algorithm
---------
Everything is laid out by sequence position, never by slot or padded length.
Queries go to tiles of BLOCK_M positions of one sequence (row = position %
BLOCK_M); keys are read in blocks of BLOCK_N positions (block i = positions
[i * BLOCK_N, (i + 1) * BLOCK_N)), BLOCK_N a multiple of BLOCK_M, so every row
of a tile needs the same blocks 0..nb-1, nb = tile start // BLOCK_N + 1.
The blocks are cut into KV splits of SPLIT_BLOCKS blocks (a fixed split size,
in positions, independent of the query count).

Kernel 1, one program per (tile, query head, split): flash-style online
softmax over the split's blocks in increasing order (s = q k^T * scale, -inf
past the query's position, running max m, l = l * exp(m_old - m) + sum p,
acc = acc * exp(m_old - m) + p v). A tile with one split writes acc / l;
otherwise it writes its (m, l, acc) partials.
Kernel 2, one program per (tile, query head) of tiles with two or more
splits: m = max over splits, out = sum_s acc_s exp(m_s - m) / sum_s l_s
exp(m_s - m), splits in increasing order.

Packed rows (segments): a tile belongs to one (row, segment) sequence; the
kernels read its queries from that sequence's row (`seq_row`) and its keys
through the sequence's slot map, so a packed token runs exactly the
arithmetic of the same token in a padded row.

Prefill and decode run the very same two kernels: a decode query sits alone in
its tile, at the row it has in prefill, and sees the same blocks and splits;
its row of every dot product only reads its own query row. Keys past the
tile's last query are not loaded (0), and keys past a row's own position get
weight exactly 0, so the other rows of a tile cannot change a row's bits. The
arithmetic of a row depends only on its position: decode == prefill ==
chunked prefill, bitwise, in any batch.

Split partials are bounded: the tiles are launched in groups (`tile0`, the
group's first tile, is a kernel argument) whose partials fit PARTIALS_BYTES, or
one tile a group when a single tile's partials are larger. The partials of a
call therefore never exceed max(PARTIALS_BYTES, Hq * n_splits * BLOCK_M *
block_d * 4 B) (n_splits = ceil(L / 1024) on a GPU): linear in the sequence
length, not quadratic. A tile's arithmetic does not depend on its group.

One binary for every call: no pointer or integer argument of either kernel is
specialised (strides, lengths and split counts change with the batch and the
cache layout, and pointers with the views the callers pass). Rounding on a
GPU: exp is `ex2.approx` (as in every flash attention), the final division is
IEEE (`div_rn`). fp64 inputs: `scale` arrives as an fp32 scalar.

Host reads: the planner reads the largest query position once (it sizes the
grid and the split partials); prefill and packed calls also group the queries
into tiles on the host (`torch.unique`); the shared argument checks read
kv_index's range. Decode therefore syncs with the GPU once per layer call
(plus the kv_index check); a CUDA graph of the decode step would need these
bounds passed in. See docs/backends.md.

Backward, the op's signature, argument checks and the autograd.Function: shared
with every backend (rl_engine/kernels/common/attention.py; the backward is plain
torch, deterministic, not invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.attention import attention_op, compute_dtype, refuse_block_table
from rl_engine.kernels.common.segments import Sequences, sequences_of
from rl_engine.kernels.triton._common import INTERPRET, SERVING, div_rn, tl_dtype, upcast_dot
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

# Part of the numerics: changing them changes the bits (the same for every
# batch, so the rollout engine and the trainer agree). GPU: 64-row query tiles,
# 64-position key blocks, KV splits of 16 blocks = 1024 positions. The
# interpreter (tests on CPU) uses smaller ones: faster there, and sequences of a
# few hundred tokens then cross several splits.
BLOCK_M, BLOCK_N, SPLIT_BLOCKS = (16, 32, 4) if INTERPRET else (64, 64, 16)
assert BLOCK_N % BLOCK_M == 0

# Split partials held at once (fp32 acc, m, l of a group of tiles); only memory and the
# number of launches depend on it, never the bits.
PARTIALS_BYTES = 256 * 1024 * 1024
_NUM_WARPS = 4
_NUM_STAGES = {2: 2, 4: 1, 8: 1}  # by element size: one stage keeps fp32 / fp64 under every limit


@triton.jit
def _program_tile(tile_start_ptr, tile0, BLOCK_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr):
    """This program's tile (tile0 + grid axis 0) and query head (axis 1), the tile's first
    position, the key blocks it sees (0..n_blocks-1) and their number of KV splits."""
    tile = tile0 + tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    n_blocks = start // BLOCK_N + 1
    return tile, tl.program_id(1), start, n_blocks, tl.cdiv(n_blocks, SPLIT_BLOCKS)


@triton.jit
def _tile_rows(
    tile_b_ptr, seq_row_ptr, tile_cols_ptr, tile, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A tile's sequence b and the q row it lives in, its rows, the q column of each row
    (-1: no query), live rows, head dims."""
    b = tl.load(tile_b_ptr + tile).to(tl.int64)
    qb = tl.load(seq_row_ptr + b).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.load(tile_cols_ptr + tile * BLOCK_M + rows).to(tl.int64)  # -1: no query
    return b, qb, rows, cols, cols >= 0, tl.arange(0, BLOCK_D)


@triton.jit
def _rows_at(ptr, b, h, idx, d, s_b, s_h, s_t):
    """Pointers to rows idx (the time index) of batch row b, head h, head dims d: (len(idx), len(d))."""
    return ptr + b * s_b + h * s_h + idx[:, None] * s_t + d[None, :]


_SPLIT_ARGS = [
    "q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr", "tile_b_ptr",
    "seq_row_ptr", "tile_start_ptr", "tile_cols_ptr", "kv_row_ptr", "slot_ptr",
    "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "so_b", "so_h", "so_t",
    "Tk", "slot_len", "n_split_max", "D", "group", "tile0", "has_slots",
]  # fmt: skip


@triton.jit(do_not_specialize=_SPLIT_ARGS, do_not_specialize_on_alignment=_SPLIT_ARGS)
def _attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    tile_b_ptr,
    seq_row_ptr,
    tile_start_ptr,
    tile_cols_ptr,
    kv_row_ptr,
    slot_ptr,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_t,
    sv_b,
    sv_h,
    sv_t,
    so_b,
    so_h,
    so_t,
    Tk,
    slot_len,
    n_split_max,
    D,
    group,
    scale,
    tile0,
    has_slots,
    UPCAST: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
):
    tile, h, start, n_blocks, n_splits = _program_tile(tile_start_ptr, tile0, BLOCK_N, SPLIT_BLOCKS)
    split = tl.program_id(2)
    if split < n_splits:
        b, qb, rows, cols, live, d = _tile_rows(
            tile_b_ptr, seq_row_ptr, tile_cols_ptr, tile, BLOCK_M, BLOCK_D
        )
        kv_b = tl.load(kv_row_ptr + b).to(tl.int64)
        hk = (h // group).to(tl.int64)
        qpos = start + rows
        last = tl.max(tl.where(live, qpos, -1), axis=0)  # last query position of the tile
        dmask = d < D
        q = tl.load(
            _rows_at(q_ptr, qb, h, cols, d, sq_b, sq_h, sq_t),
            mask=live[:, None] & dmask[None, :],
            other=0.0,
        )  # (BM, BD)
        if UPCAST:
            q = q.to(ACC)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
        l_i = tl.zeros((BLOCK_M,), dtype=ACC)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
        j0 = split * SPLIT_BLOCKS
        j1 = tl.minimum(j0 + SPLIT_BLOCKS, n_blocks)
        for j in range(j0, j1):
            kpos = j * BLOCK_N + tl.arange(0, BLOCK_N)
            # k_positions given: the slot that holds each position (-1: none); else slot = position.
            # A runtime flag, not a constexpr: every layout runs the same compiled kernel.
            mapped = tl.load(slot_ptr + b * slot_len + kpos, mask=kpos < slot_len, other=-1)
            slots = tl.where(kpos * 0 + has_slots != 0, mapped.to(tl.int64), kpos.to(tl.int64))
            kmask = (kpos <= last) & (slots >= 0) & (slots < Tk)
            kvmask = kmask[:, None] & dmask[None, :]
            k = tl.load(
                _rows_at(k_ptr, kv_b, hk, slots, d, sk_b, sk_h, sk_t), mask=kvmask, other=0.0
            )  # (BN, BD)
            if UPCAST:
                k = k.to(ACC)
            else:
                k = k.to(q.dtype)  # an fp32 cache of bf16 keys converts back exactly
            if UPCAST:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BM, BN)
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                _rows_at(v_ptr, kv_b, hk, slots, d, sv_b, sv_h, sv_t), mask=kvmask, other=0.0
            )  # (BN, BD)
            if UPCAST:
                v = v.to(ACC)
            else:
                v = v.to(q.dtype)
                p = p.to(q.dtype)
            if UPCAST:
                acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p, v, acc * alpha[:, None])
            m_i = m_new
        if n_splits == 1:
            o = div_rn(acc, l_i[:, None], ACC)
            tl.store(
                _rows_at(out_ptr, qb, h, cols, d, so_b, so_h, so_t),
                o.to(out_ptr.dtype.element_ty),
                mask=live[:, None] & dmask[None, :],
            )
        else:
            n_heads = tl.num_programs(1)
            # (tile of the group, head, split)
            part = ((tl.program_id(0) * n_heads + h) * n_split_max + split).to(tl.int64)
            tl.store(
                part_acc_ptr + part * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :], acc
            )
            tl.store(part_ml_ptr + part * 2 * BLOCK_M + rows, m_i)
            tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows, l_i)


_COMBINE_ARGS = [
    "out_ptr", "part_acc_ptr", "part_ml_ptr", "tile_b_ptr", "seq_row_ptr", "tile_start_ptr",
    "tile_cols_ptr", "so_b", "so_h", "so_t", "n_split_max", "D", "tile0",
]  # fmt: skip


@triton.jit(do_not_specialize=_COMBINE_ARGS, do_not_specialize_on_alignment=_COMBINE_ARGS)
def _attention_combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    tile_b_ptr,
    seq_row_ptr,
    tile_start_ptr,
    tile_cols_ptr,
    so_b,
    so_h,
    so_t,
    n_split_max,
    D,
    tile0,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
):
    tile, h, _start, _blocks, n_splits = _program_tile(tile_start_ptr, tile0, BLOCK_N, SPLIT_BLOCKS)
    if n_splits > 1:
        _b, qb, rows, cols, live, d = _tile_rows(
            tile_b_ptr, seq_row_ptr, tile_cols_ptr, tile, BLOCK_M, BLOCK_D
        )
        base = ((tl.program_id(0) * tl.num_programs(1) + h) * n_split_max).to(tl.int64)
        m = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
        for s in range(0, n_splits):
            m = tl.maximum(m, tl.load(part_ml_ptr + (base + s) * 2 * BLOCK_M + rows))
        l_sum = tl.zeros((BLOCK_M,), dtype=ACC)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
        for s in range(0, n_splits):
            m_s = tl.load(part_ml_ptr + (base + s) * 2 * BLOCK_M + rows)
            l_s = tl.load(part_ml_ptr + (base + s) * 2 * BLOCK_M + BLOCK_M + rows)
            acc_s = tl.load(
                part_acc_ptr + (base + s) * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :]
            )
            w = tl.exp(m_s - m)
            l_sum = l_sum + l_s * w
            acc = acc + acc_s * w[:, None]
        o = div_rn(acc, l_sum[:, None], ACC)
        tl.store(
            _rows_at(out_ptr, qb, h, cols, d, so_b, so_h, so_t),
            o.to(out_ptr.dtype.element_ty),
            mask=live[:, None] & (d[None, :] < D),
        )


def _plan_tiles(q_positions: torch.Tensor, seqs: Sequences | None = None):
    """Valid queries grouped into (sequence, tile) pairs.

    Returns (tile_b (NT,), tile_start (NT,), tile_cols (NT, BLOCK_M)) int32:
    each tile's sequence (a batch row, or with `seqs` one of its sequences),
    first position, and the q column of each of its rows (-1 where no query
    holds that position). Only speed depends on the order of the tiles. Decode
    (Tq == 1) makes the same tiles, one per row (a padding row's tile has no
    query), without torch.unique.
    """
    pos = q_positions.long()
    if pos.shape[1] == 1 and seqs is None:  # decode: one tile per row, planned without host syncs
        p = pos[:, 0].clamp(min=0)  # (B,)
        rows = torch.arange(pos.shape[0], device=pos.device)
        tile_cols = torch.full((pos.shape[0], BLOCK_M), -1, dtype=torch.int32, device=pos.device)
        tile_cols[rows, p % BLOCK_M] = torch.where(pos[:, 0] >= 0, 0, -1).to(torch.int32)
        return rows.to(torch.int32), (p // BLOCK_M * BLOCK_M).to(torch.int32), tile_cols
    qb, qcol = (pos >= 0).nonzero(as_tuple=True)  # (N,)
    p = pos[qb, qcol]
    sid = qb if seqs is None else seqs.q_seq[qb, qcol]
    n_tiles = int(p.max()) // BLOCK_M + 1
    key = sid * n_tiles + p // BLOCK_M
    uniq, inv = torch.unique(key, return_inverse=True)
    row = p % BLOCK_M
    if torch.unique(inv * BLOCK_M + row).numel() != p.numel():
        raise ValueError("q_positions: a sequence has the same position twice")
    tile_cols = torch.full((uniq.numel(), BLOCK_M), -1, dtype=torch.int32, device=pos.device)
    tile_cols[inv, row] = qcol.to(torch.int32)
    tile_b = (uniq // n_tiles).to(torch.int32)
    tile_start = ((uniq % n_tiles) * BLOCK_M).to(torch.int32)
    return tile_b, tile_start, tile_cols


def _slot_map(k_positions: torch.Tensor, length: int, seqs: Sequences | None = None):
    """(S, length) int32: the key slot that holds each position of each sequence, -1 where
    none does. A sequence is a batch row (S = B), or one of `seqs`' sequences."""
    kp = k_positions.long()
    if seqs is None:  # a scatter: no host read (decode's cache layout)
        B, Tk = kp.shape
        visible = (kp >= 0) & (kp < length)
        where = torch.where(visible, kp, length)  # invisible slots land in a dropped column
        slot = torch.arange(Tk, dtype=torch.int32, device=kp.device).expand(B, Tk)
        slots = torch.full((B, length + 1), -1, dtype=torch.int32, device=kp.device)
        return slots.scatter_(1, where, slot)[:, :length].contiguous()
    slots = torch.full((seqs.count, length), -1, dtype=torch.int32, device=kp.device)
    visible = (kp >= 0) & (kp < length) & (seqs.k_seq >= 0)
    sb, slot = visible.nonzero(as_tuple=True)
    slots[seqs.k_seq[sb, slot], kp[sb, slot]] = slot.to(torch.int32)
    return slots


def attention_forward(
    q, k, v, q_positions, k_positions, scale, kv_index, q_segments=None, k_segments=None
):
    """(B, Hq, Tq, D) in q.dtype; exact zeros for padding queries."""
    refuse_block_table(kv_index, "triton")
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return out
    max_pos = int(q_positions.max())  # the one host read of decode: it sizes the grid
    if max_pos < 0:
        return out
    for launch in attention_launches(
        q, k, v, out, q_positions, k_positions, scale, kv_index, q_segments, k_segments, max_pos
    ):
        launch.run()
    return out


def attention_launches(
    q, k, v, out, q_positions, k_positions, scale, kv_index, q_segments, k_segments, max_pos
) -> list[Launch]:
    """Every launch of one attention call, in order: per group of tiles, the split kernel, then
    (when a tile has several KV splits) the combine kernel. `max_pos` = q_positions.max() >= 0."""
    B, Hq, _, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    # the kernels take every stride but the head dim's, which must be 1
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    seqs = None
    if q_segments is not None:  # packed rows: a tile belongs to one (row, segment) sequence
        seqs = sequences_of(q_positions, q_segments, k_positions, k_segments)
    tile_b, tile_start, tile_cols = _plan_tiles(q_positions, seqs)
    NT = tile_b.numel()
    max_start = max_pos // BLOCK_M * BLOCK_M  # the last tile's start (tile starts are p // BLOCK_M)
    n_split_max = triton.cdiv(max_start // BLOCK_N + 1, SPLIT_BLOCKS)
    rows = torch.arange(B, dtype=torch.int32, device=q.device)
    seq_row = rows if seqs is None else seqs.row.to(torch.int32)  # q row of each sequence
    kv_row = kv_index.to(torch.int32) if kv_index is not None else seq_row
    if k_positions is not None:
        slots = _slot_map(k_positions, max_start + BLOCK_M, seqs)
        slot_len = slots.shape[1]
    else:
        slots, slot_len = tile_b, 0  # unused: aligned layout
    acc_dtype = compute_dtype(q.dtype)
    block_d = max(16, triton.next_power_of_2(D))
    group = _tiles_per_group(NT, Hq, n_split_max, block_d, acc_dtype)
    if n_split_max > 1:
        part_acc = torch.empty(
            (group, Hq, n_split_max, BLOCK_M, block_d), dtype=acc_dtype, device=q.device
        )
        part_ml = torch.empty(
            (group, Hq, n_split_max, 2, BLOCK_M), dtype=acc_dtype, device=q.device
        )
    else:  # unused; fp32 all the same, so that every call runs one compiled kernel
        part_acc = part_ml = torch.empty(1, dtype=acc_dtype, device=q.device)
    # what both kernels take: the output, the split partials, the tile plan
    tiles = (out, part_acc, part_ml, tile_b, seq_row, tile_start, tile_cols)
    meta = dict(
        ACC=tl_dtype(acc_dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        SPLIT_BLOCKS=SPLIT_BLOCKS,
    )
    split_args = (
        q,
        k,
        v,
        *tiles,
        kv_row,
        slots,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        Tk,
        slot_len,
        n_split_max,
        D,
        Hq // Hkv,
        float(scale),
    )
    launches = []
    for tile0 in range(0, NT, group):
        n = min(group, NT - tile0)
        launches.append(
            Launch(
                variant=f"split_d{block_d}",
                kernel=_attention_split_kernel,
                grid=(n, Hq, n_split_max),
                args=(*split_args, tile0, int(k_positions is not None)),
                constexprs=dict(UPCAST=upcast_dot(q.dtype), **meta),
                num_warps=_NUM_WARPS,
                num_stages=_NUM_STAGES[q.element_size()],
                fp_fusion=FP_FUSION,
            )
        )
        if n_split_max > 1:
            launches.append(
                Launch(
                    variant=f"combine_d{block_d}",
                    kernel=_attention_combine_kernel,
                    grid=(n, Hq),
                    args=(*tiles, *out.stride()[:3], n_split_max, D, tile0),
                    constexprs=meta,
                    num_warps=_NUM_WARPS,
                    num_stages=1,
                    fp_fusion=FP_FUSION,
                )
            )
    return launches


def _tiles_per_group(n_tiles: int, heads: int, n_split_max: int, block_d: int, acc_dtype) -> int:
    """Tiles launched together: as many as keep their split partials within PARTIALS_BYTES
    (at least one). Only memory and launch count depend on it."""
    if n_split_max == 1:
        return n_tiles
    per_tile = heads * n_split_max * BLOCK_M * (block_d + 2) * acc_dtype.itemsize
    return max(1, min(n_tiles, PARTIALS_BYTES // per_tile))


attention = attention_op(attention_forward, SERVING, __name__)
