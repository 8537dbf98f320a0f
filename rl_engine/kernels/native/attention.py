"""Batch-invariant causal attention (grouped-query) in plain torch.

Contract
--------
``attention(q, k, v, *, q_positions, k_positions=None, scale=None, kv_index=None,
q_segments=None, k_segments=None)``

- ``q``: (B, Hq, Tq, D); ``k``, ``v``: (B, Hkv, Tk, D); ``Hq % Hkv == 0`` and query
  head ``h`` reads kv head ``h // (Hq // Hkv)``. fp32, bf16 (or fp64, for gradcheck);
  k and v may also be in the compute dtype (fp32 keys for bf16 queries: exact).
- ``kv_index``: integer (B,) or None (aligned layout only). Row b reads
  ``k[kv_index[b]]``, ``v[kv_index[b]]`` of (S, Hkv, Tk, D) caches, S any batch
  size: a KV cache's slots, without a gather. Contiguous fp32 caches with Tk a
  multiple of BLOCK_K are read in place by decode, so their slots past each
  sequence's last query must then hold finite values.
- ``q_positions``: integer (B, Tq), 0-based position of each query in its own
  sequence; negative = padding query, whose output row is exactly 0.
- ``k_positions``: integer (B, Tk) or None. Position held by each key slot,
  negative = empty slot. None = aligned (KV-cache) layout: slot j holds position j.
- ``q_segments`` (B, Tq) / ``k_segments`` (B, Tk): integer or None (both or
  neither, with k_positions): packed rows. A sequence is then a (row, segment)
  pair and a query attends only to keys of its own segment.
- Causal: the query at position p attends to positions 0..p of its sequence
  (which must all be present once). Statistics and accumulation in fp32
  (fp64 for fp64 inputs); output in ``q.dtype``.

Invariance: the output row of (sequence, head, position p) is bitwise the same
whatever the batch composition, the padding (left / right / any Tk, any finite
garbage in empty or past-the-end slots), the packing (alone or packed with other
sequences in a row), prefill vs decode vs chunked prefill, and the intra-op
thread count, for every dtype this machine's platform probe accepts (the
fixed-shape GEMMs below rest on its assumption: platform_probe.py); a dtype it
refuses raises PlatformInvarianceError, as the GEMM ops do. Packed rows change
the bookkeeping only: tiles and key blocks belong to sequences
(common/segments.py), never to rows.

Algorithm
---------
Everything is laid out by sequence position, never by slot or padded length.
Keys and values go to blocks of ``BLOCK_K`` positions, block i = positions
[i * BLOCK_K, (i + 1) * BLOCK_K) of one sequence. Queries go to tiles of
``BLOCK_Q`` positions (row = position % BLOCK_Q), the ``G = Hq // Hkv`` heads of
a kv group stacked, so a tile is a (G * BLOCK_Q, D) matrix. A tile and one key
block it can see form a *cell*; for every cell:

    s    = q_tile @ k_block^T             fixed-shape GEMM (G*BQ, D) x (D, BK)
    s    = -inf where key position > query position
    m    = row max over all cells of the tile  (max is exact in any order)
    p    = exp(s - m)
    l_c  = row sum of p (length BK);  o_c = p @ v_block   (fixed-shape GEMM)

and the tile's output is tree(o_c) / tree(l_c), with _tree_sum_ a pairwise sum
over the cells whose structure depends only on the number of blocks the tile
sees. Fixed-shape GEMMs give a row the same bits whatever the batch count, and
every other step is elementwise or a per-row reduction, so prefill, decode (a
query alone in its tile: the tile shape and the row slot are the same as in
prefill) and chunked prefill do the very same arithmetic on a row. Cells are
batched over all tiles of all sequences; only speed depends on the batching.

Decode path (every Tq == 1, aligned keys: _decode_forward) does the same
arithmetic per row without tile planning: each query goes into row p % BLOCK_Q
of its own zero tile, through the same two fixed-shape GEMMs per cell (keys in
(sequence, kv head, block) order, read in place from a suitable cache), and
only its G rows go through mask, max, exp, row sums and the tree sums. Those
steps are elementwise or per-row, and GEMM rows do not depend on the other
rows of the tile, so the bits equal the tiled path's. Garbage past a query
(zeroed here, or the cache's finite values when read in place) gets weight 0.

The op's signature, argument checks, the backward (plain masked-softmax gradients
in torch: deterministic, not invariant) and the autograd.Function are shared by
every backend: rl_engine/kernels/common/attention.py.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.attention import attention_op, refuse_block_table
from rl_engine.kernels.common.attention import compute_dtype as _compute_dtype
from rl_engine.kernels.common.segments import Sequences, sequence_lengths, sequences_of
from rl_engine.kernels.native._serving import GEMM

# Query tile rows and key block length (positions). BLOCK_K must be a multiple
# of BLOCK_Q, and both are part of the numerics: changing them changes the bits.
BLOCK_Q = 16
BLOCK_K = 128
_RATIO = BLOCK_K // BLOCK_Q
assert BLOCK_K % BLOCK_Q == 0

# ----------------------------------------------------------------------------- forward


def _plan_tiles(q_positions: torch.Tensor, seqs: Sequences | None = None):
    """Group the valid queries into (sequence, tile) pairs.

    Returns (qb, qcol, row, inv, tile_b, tile_t): for every valid query its
    batch row, column in q and row in its tile, the index of its tile; for every
    tile its sequence and tile number. A sequence is a batch row, or with
    `seqs` (packed rows) one of seqs' sequences. Tiles are sorted by tile number
    descending, so neighbours see about as many key blocks (little padding
    when they share a batched step).
    """
    pos = q_positions.long()
    qb, qcol = (pos >= 0).nonzero(as_tuple=True)  # (N,)
    p = pos[qb, qcol]
    S = pos.shape[0] if seqs is None else seqs.count
    sid = qb if seqs is None else seqs.q_seq[qb, qcol]  # (N,) sequence of each query
    tile = p // BLOCK_Q
    max_tile = int(tile.max())
    key = (max_tile - tile) * S + sid
    uniq, inv = torch.unique(key, return_inverse=True)  # ascending key = descending tile
    # Two queries of one sequence at one position would share a tile row.
    if torch.unique(key * BLOCK_Q + p % BLOCK_Q).numel() != p.numel():
        raise ValueError("q_positions: a sequence has the same position twice")
    tile_b = uniq % S
    tile_t = max_tile - uniq // S
    return qb, qcol, p % BLOCK_Q, inv, tile_b, tile_t


def _key_blocks(
    x,
    k_positions,
    nblk: int,
    seq_len: torch.Tensor,
    cdt,
    *,
    heads_first: bool = False,
    k_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keys or values by position, cut in blocks: (S * nblk, Hkv, BLOCK_K, D) in cdt.

    Block i of sequence b is row b * nblk + i and holds positions
    [i * BLOCK_K, (i + 1) * BLOCK_K). A sequence is a batch row (S = B), or with
    k_seq (packed rows: the sequence of every key slot, -1 = none) one of
    seq_len's S sequences. Positions >= seq_len[b] (past the last query of b:
    never visible) are zeroed, so that garbage there, even inf or nan, cannot
    leak through a 0 weight. heads_first (aligned layout only): (B * Hkv * nblk,
    BLOCK_K, D) instead, block i of (b, h) at (b * Hkv + h) * nblk + i, the
    layout of the decode path.
    """
    B, Hkv, Tk, D = x.shape
    L = nblk * BLOCK_K
    if k_positions is not None:
        S = seq_len.shape[0]
        buf = torch.zeros((S, nblk, Hkv, BLOCK_K, D), dtype=cdt, device=x.device)
        kp = k_positions.long()
        seq = torch.arange(B, device=x.device)[:, None].expand(B, Tk) if k_seq is None else k_seq
        visible = (seq >= 0) & (kp >= 0) & (kp < seq_len[seq.clamp(min=0)])
        sb, slot = visible.nonzero(as_tuple=True)
        p, sid = kp[sb, slot], seq[sb, slot]
        buf[sid, p // BLOCK_K, :, p % BLOCK_K] = x.transpose(1, 2)[sb, slot].to(cdt)  # (N, Hkv, D)
        return buf.view(S * nblk, Hkv, BLOCK_K, D)
    if heads_first:
        buf = torch.empty((B, Hkv, nblk, BLOCK_K, D), dtype=cdt, device=x.device)
        dst = buf
    else:
        buf = torch.empty((B, nblk, Hkv, BLOCK_K, D), dtype=cdt, device=x.device)
        dst = buf.permute(0, 2, 1, 3, 4)  # (B, Hkv, nblk, BK, D) view of buf
    full = min(Tk // BLOCK_K, nblk)  # blocks wholly inside x
    dst[:, :, :full] = x[:, :, : full * BLOCK_K].view(B, Hkv, full, BLOCK_K, D)
    if full < nblk:  # partial last block
        rest = min(Tk, L) - full * BLOCK_K
        dst[:, :, full:].zero_()
        dst[:, :, full, :rest] = x[:, :, full * BLOCK_K : full * BLOCK_K + rest]
    if bool((seq_len < min(Tk, L)).any()):
        pos = torch.arange(L, device=x.device).view(1, 1, nblk, BLOCK_K, 1)
        dst.masked_fill_(pos >= seq_len.view(B, 1, 1, 1, 1), 0.0)
    if heads_first:
        return buf.view(B * Hkv * nblk, BLOCK_K, D)
    return buf.view(B * nblk, Hkv, BLOCK_K, D)


_MASKS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _mask_table(G: int, device) -> torch.Tensor:
    """(RATIO + 2, G*BLOCK_Q, BLOCK_K) bool, True = key after query (masked).

    Entry d < RATIO: a tile starting d * BLOCK_Q positions into the key block;
    entry RATIO: block wholly before the tile (nothing masked); entry RATIO + 1:
    block wholly after the tile (all masked). Rows are g * BLOCK_Q + r.
    """
    key = (G, torch.device(device))
    if key not in _MASKS:
        r = torch.arange(BLOCK_Q, device=device)
        c = torch.arange(BLOCK_K, device=device)
        d = torch.arange(_RATIO, device=device)
        diag = c[None, None, :] > (d[:, None, None] * BLOCK_Q + r[None, :, None])  # (R, BQ, BK)
        none = torch.zeros((1, BLOCK_Q, BLOCK_K), dtype=torch.bool, device=device)
        table = torch.cat([diag, none, ~none]).repeat(1, G, 1)
        _MASKS[key] = table
    return _MASKS[key]


def _tree_sum_(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """Sum the first n entries of x along dim by folding halves: x[i] += x[i + h], h = largest 2^k < n.

    The order of additions depends only on n, and zero entries appended after
    n leave the result bitwise unchanged, so tiles with different numbers of
    key blocks can share one padded tensor. In place; returns entry 0.
    """
    while n > 1:
        h = 1 << ((n - 1).bit_length() - 1)
        x.narrow(dim, 0, n - h).add_(x.narrow(dim, h, n - h))
        n = h
    return x.select(dim, 0)


# Score elements (cells * Hkv * G*BLOCK_Q * BLOCK_K) per batched step: keeps the
# working set of one step in cache. Only speed depends on it, never the bits.
_STEP_ELEMS = 1 << 18


def _tile_groups(nb: list[int], cell_elems: int):
    """Consecutive runs of tiles (sorted by block count, descending) per step."""
    groups, j0 = [], 0
    while j0 < len(nb):
        j1 = j0 + 1
        while j1 < len(nb) and (j1 + 1 - j0) * nb[j0] * cell_elems <= _STEP_ELEMS:
            j1 += 1
        groups.append((j0, j1))
        j0 = j1
    return groups


def _forward(q, k, v, q_positions, k_positions, scale, seqs: Sequences | None = None):
    """Invariant forward: (B, Hq, Tq, D) in the compute dtype (fp32, fp64).

    For every query tile and every key block it can see (a "cell"), one
    fixed-shape GEMM gives the scores; the row max over all cells is exact in
    any order; p = exp(s - max); each cell's row sums and p @ v (again a
    fixed-shape GEMM) are then summed over the tile's blocks by _tree_sum_.
    Tiles and key blocks belong to sequences: batch rows, or `seqs` (packed
    rows), whose tiles and blocks are then exactly those of the sequence alone.
    """
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    G, GQ = Hq // Hkv, (Hq // Hkv) * BLOCK_Q
    cdt = _compute_dtype(q.dtype)
    if not bool((q_positions >= 0).any()):
        return torch.zeros(q.shape, dtype=cdt, device=q.device)

    qb, qcol, row, inv, tile_b, tile_t = _plan_tiles(q_positions, seqs)
    NT = tile_b.numel()
    nb = (tile_t // _RATIO + 1).tolist()  # key blocks each tile sees, descending
    nblk = nb[0]
    if seqs is None:
        seq_len = q_positions.long().amax(1) + 1  # (B,) positions any query of b can see
    else:
        seq_len = sequence_lengths(q_positions, seqs)  # (S,)
    k_seq = None if seqs is None else seqs.k_seq
    kblk = _key_blocks(k, k_positions, nblk, seq_len, cdt, k_seq=k_seq)  # (S*nblk, Hkv, BK, D)
    vblk = _key_blocks(v, k_positions, nblk, seq_len, cdt, k_seq=k_seq)

    # Query tiles, pre-scaled, heads of a kv group stacked: (NT, Hkv, G*BQ, D).
    # Rows are moved as whole (Hq, D) slabs: index_select / index_copy_ are far
    # faster than advanced indexing here.
    src = q.transpose(1, 2).reshape(B * Tq, Hq, D).index_select(0, qb * Tq + qcol)  # (N, Hq, D)
    slot = inv * BLOCK_Q + row  # (N,) row of each query in (NT * BQ)
    qt = torch.zeros((NT * BLOCK_Q, Hq, D), dtype=cdt, device=q.device)
    qt.index_copy_(0, slot, src.to(cdt) * scale)
    qt = qt.view(NT, BLOCK_Q, Hkv, GQ // BLOCK_Q, D).permute(0, 2, 3, 1, 4).reshape(NT, Hkv, GQ, D)
    res = torch.empty((NT, Hkv, GQ, D), dtype=cdt, device=q.device)
    table = _mask_table(G, q.device)

    tb = tile_b.tolist()
    blk = torch.arange(nblk, device=q.device)
    diag = table[tile_t % _RATIO]  # (NT, G*BQ, BK): mask of each tile's last block
    for j0, j1 in _tile_groups(nb, Hkv * GQ * BLOCK_K):
        n, NB = j1 - j0, nb[j0]
        if n == 1:  # one tile (decode, long prefill tiles): its blocks are a slice
            kc, vc = kblk[tb[j0] * nblk :][:NB], vblk[tb[j0] * nblk :][:NB]  # (NB, Hkv, BK, D)
        else:
            cells = (tile_b[j0:j1, None] * nblk + blk[:NB]).view(-1)  # (tile, block) pairs
            kc = kblk.index_select(0, cells)  # (n*NB, Hkv, BK, D)
            vc = vblk.index_select(0, cells)
        qc = qt[j0:j1, None].expand(n, NB, Hkv, GQ, D).reshape(-1, GQ, D)
        s = torch.bmm(qc, kc.view(-1, BLOCK_K, D).transpose(1, 2))
        s = s.view(n, NB, Hkv, GQ, BLOCK_K)  # scores of every cell

        if nb[j1 - 1] == NB:  # causal mask: only the last block of each tile
            s[:, NB - 1].masked_fill_(diag[j0:j1].unsqueeze(1), float("-inf"))
        else:  # tiles see different block counts: mask from the first partial one
            c0 = nb[j1 - 1] - 1
            d = tile_t[j0:j1, None] - blk[None, c0:NB] * _RATIO  # tile offset into block
            d = torch.where(d < 0, _RATIO + 1, d.clamp(max=_RATIO))
            s[:, c0:].masked_fill_(table[d].unsqueeze(2), float("-inf"))

        m = s.amax(-1).amax(1)[:, None, :, :, None]  # (n, 1, Hkv, GQ, 1); max is exact in any order
        s.sub_(m).exp_()
        rs = s.sum(-1)  # (n, NB, Hkv, GQ)
        pv = torch.bmm(s.view(-1, GQ, BLOCK_K), vc.view(-1, BLOCK_K, D)).view(n, NB, Hkv, GQ, D)
        l_sum = _tree_sum_(rs, NB)  # (n, Hkv, GQ)
        acc = _tree_sum_(pv, NB)  # (n, Hkv, GQ, D)
        torch.div(acc, l_sum.unsqueeze(-1), out=res[j0:j1])

    res = res.view(NT, Hq, BLOCK_Q, D).transpose(1, 2).reshape(NT * BLOCK_Q, Hq, D)
    out = torch.zeros((B * Tq, Hq, D), dtype=cdt, device=q.device)
    out.index_copy_(0, qb * Tq + qcol, res.index_select(0, slot))
    return out.view(B, Tq, Hq, D).transpose(1, 2).contiguous()  # (B, Hq, Tq, D)


# ----------------------------------------------------------------------------- decode


def _blocks_view(x: torch.Tensor, cdt) -> torch.Tensor | None:
    """x (S, Hkv, Tk, D) as (S * Hkv * Tk/BLOCK_K, BLOCK_K, D) blocks without a copy, or None.

    Block i of (row s, head h) is (s * Hkv + h) * nblk + i. Possible when x is
    contiguous, in the compute dtype and Tk is a multiple of BLOCK_K (the
    rollout cache is allocated so).
    """
    if x.dtype != cdt or not x.is_contiguous() or x.shape[2] % BLOCK_K != 0:
        return None
    return x.view(-1, BLOCK_K, x.shape[3])


def _decode_cells(blocks, nblk: int, Hkv: int, rows: list[int], NB: int) -> torch.Tensor:
    """Blocks 0..NB-1 of every kv head of the rows `rows`: (len(rows) * Hkv * NB, BLOCK_K, D).

    blocks: (S * Hkv * nblk, BLOCK_K, D) as made by _blocks_view. A free slice
    when the rows are consecutive and NB == nblk, else an index_select of just
    the blocks needed.
    """
    n = len(rows)
    if NB == nblk and rows == list(range(rows[0], rows[0] + n)):
        return blocks[rows[0] * Hkv * nblk :][: n * Hkv * nblk]
    dev = blocks.device
    r = torch.tensor(rows, device=dev).view(n, 1, 1)
    heads = torch.arange(Hkv, device=dev).view(1, Hkv, 1)
    idx = (r * Hkv + heads) * nblk + torch.arange(NB, device=dev).view(1, 1, NB)
    return blocks.index_select(0, idx.view(-1))


def _decode_group(qg, pg, kc, vc, NB: int, scale: float, cdt) -> torch.Tensor:
    """n decode queries against their first NB key blocks: (n, Hq, D) in cdt.

    qg: (n, Hq, D); pg: (n,) positions; kc, vc: (n * Hkv * NB, BLOCK_K, D).
    Each query sits in row p % BLOCK_Q of its own zero tile, exactly as in
    _forward, and goes through the same fixed-shape GEMMs; only its G rows
    (one per head of the group) go through mask, exp and the sums.
    """
    n, Hq, D = qg.shape
    Hkv = kc.shape[0] // (n * NB)
    G, GQ = Hq // Hkv, (Hq // Hkv) * BLOCK_Q
    dev = qg.device
    r = (pg % BLOCK_Q).view(n, 1)  # row of each query in its tiles
    # tiles (n, Hkv, G, BQ, D) = (n * Hkv, GQ, D), zero but for row g * BQ + r of each head g
    qt = torch.zeros((n * Hq * BLOCK_Q, D), dtype=cdt, device=dev)
    qrows = (torch.arange(n * Hq, device=dev).view(n, Hq) * BLOCK_Q + r).view(-1)
    qt.index_copy_(0, qrows, qg.reshape(n * Hq, D).to(cdt) * scale)
    qt = qt.view(n * Hkv, 1, GQ, D).expand(n * Hkv, NB, GQ, D).reshape(-1, GQ, D)

    s = torch.bmm(qt, kc.transpose(1, 2))  # (n*Hkv*NB, GQ, BK): scores of every cell
    # the query rows of s, (n, Hkv, NB, G) of them
    srows = (torch.arange(n * Hkv * NB * G, device=dev).view(n, -1) * BLOCK_Q + r).view(-1)
    sq = s.view(-1, BLOCK_K).index_select(0, srows).view(n, Hkv, NB, G, BLOCK_K)
    kpos = torch.arange(NB * BLOCK_K, device=dev).view(1, NB, BLOCK_K)
    sq.masked_fill_((kpos > pg.view(n, 1, 1)).view(n, 1, NB, 1, BLOCK_K), float("-inf"))
    m = sq.amax(-1).amax(2, keepdim=True).unsqueeze(-1)  # (n, Hkv, 1, G, 1)
    sq.sub_(m).exp_()
    rs = sq.sum(-1)  # (n, Hkv, NB, G)
    # p @ v on the tile: the query rows of s now hold p; the others (zero queries) are ignored
    s.view(-1, BLOCK_K).index_copy_(0, srows, sq.view(-1, BLOCK_K))
    pv = torch.bmm(s, vc).view(-1, D).index_select(0, srows).view(n, Hkv, NB, G, D)
    l_sum = _tree_sum_(rs, NB, 2)  # (n, Hkv, G)
    acc = _tree_sum_(pv, NB, 2)  # (n, Hkv, G, D)
    return torch.div(acc, l_sum.unsqueeze(-1)).view(n, Hq, D)


def _decode_forward(q, k, v, q_positions, kv_index, scale):
    """Forward when every query is alone (Tq == 1) and keys are aligned: (B, Hq, 1, D) in cdt.

    The same arithmetic per row as _forward (see _decode_group), without tile
    planning. kv_index (B,) or None: row b reads k[kv_index[b]], read in place
    when _blocks_view allows it (the rollout cache); otherwise the keys are
    copied to zero-padded blocks as in _forward.
    """
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    cdt = _compute_dtype(q.dtype)
    pos = q_positions[:, 0].long()  # (B,)
    pos_l = pos.tolist()
    nb = [p // BLOCK_K + 1 for p in pos_l]  # key blocks each query sees; 0 = padding
    out = torch.zeros((B, Hq, D), dtype=cdt, device=q.device)
    kblk = _blocks_view(k, cdt) if kv_index is not None else None
    vblk = _blocks_view(v, cdt) if kblk is not None else None
    if vblk is not None:
        rows, nblk = kv_index.tolist(), k.shape[2] // BLOCK_K
    else:
        if kv_index is not None:
            k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
        rows, nblk = list(range(B)), max(nb)
        kblk = _key_blocks(k, None, nblk, pos + 1, cdt, heads_first=True)
        vblk = _key_blocks(v, None, nblk, pos + 1, cdt, heads_first=True)
    order = sorted((b for b in range(B) if nb[b] > 0), key=lambda b: -nb[b])  # stable
    for j0, j1 in _tile_groups([nb[b] for b in order], Hkv * Hq // Hkv * BLOCK_Q * BLOCK_K):
        grp, NB = order[j0:j1], nb[order[j0]]
        kc = _decode_cells(kblk, nblk, Hkv, [rows[b] for b in grp], NB)
        vc = _decode_cells(vblk, nblk, Hkv, [rows[b] for b in grp], NB)
        if grp == list(range(grp[0], grp[0] + len(grp))):  # consecutive: slices, no copies
            sl = slice(grp[0], grp[0] + len(grp))
            out[sl] = _decode_group(q[sl, :, 0], pos[sl], kc, vc, NB, scale, cdt)
        else:
            idx = torch.tensor(grp, device=q.device)
            res = _decode_group(q[:, :, 0].index_select(0, idx), pos[idx], kc, vc, NB, scale, cdt)
            out.index_copy_(0, idx, res)
    return out.unsqueeze(2)


# ----------------------------------------------------------------------------- the op


def _forward_any(q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments):
    """Dispatch: decode path (Tq == 1, aligned keys), packed rows, or the general tiled forward."""
    if q_segments is not None:
        seqs = sequences_of(q_positions, q_segments, k_positions, k_segments)
        if seqs.count == 0:
            return torch.zeros(q.shape, dtype=_compute_dtype(q.dtype), device=q.device)
        return _forward(q, k, v, q_positions, k_positions, scale, seqs)
    if k_positions is None and q.shape[2] == 1:
        if not bool((q_positions >= 0).any()):
            return torch.zeros(q.shape, dtype=_compute_dtype(q.dtype), device=q.device)
        return _decode_forward(q, k, v, q_positions, kv_index, scale)
    if kv_index is not None:
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    return _forward(q, k, v, q_positions, k_positions, scale)


def attention_forward(
    q, k, v, q_positions, k_positions, scale, kv_index, q_segments=None, k_segments=None
):
    """(B, Hq, Tq, D) in q.dtype; empty q -> zeros."""
    refuse_block_table(kv_index, "native")
    if q.numel() == 0:
        return q.new_zeros(q.shape)
    out = _forward_any(q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments)
    return out.to(q.dtype)


# The scores and p @ v are fixed-shape library GEMMs (torch.bmm): their bits rest on the
# platform assumption the probe measures (a thread count changed them on an AVX-512 Xeon).
attention = attention_op(attention_forward, GEMM, __name__)
