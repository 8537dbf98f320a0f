"""Packed rows: which sequence each query and key of an attention call belongs to.

A packed row holds several sequences one after another. The attention op then
gets, next to each token's position in its own sequence, its *segment*: an
integer id shared by the tokens of one sequence within a row
(`q_segments` / `k_segments`, docs/ops/attention.md). The backends compute
attention per *sequence* = (row, segment) pair, never per row, so a sequence
gets exactly the arithmetic it gets alone in its own row (the padded layout) or
in the engine's KV cache: every backend's reduction structure is laid out by
position within the sequence, and only the bookkeeping here changes.

`sequences_of` numbers the sequences that have at least one query, in (row,
segment id) order, and maps every query and key slot to its sequence (-1:
padding query, empty slot, or a segment no query asks for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sequences:
    """The sequences of one attention call (see the module docstring)."""

    count: int
    """Number of sequences with at least one query."""
    q_seq: torch.Tensor
    """(B, Tq) int64: sequence of each query; -1 = padding query."""
    k_seq: torch.Tensor
    """(B, Tk) int64: sequence of each key slot; -1 = empty slot or a segment nobody queries."""
    row: torch.Tensor
    """(count,) int64: the batch row each sequence lives in."""


def sequences_of(
    q_positions: torch.Tensor,
    q_segments: torch.Tensor,
    k_positions: torch.Tensor,
    k_segments: torch.Tensor,
) -> Sequences:
    """Number the (row, segment) pairs of the valid queries and map queries and keys to them."""
    B, Tq = q_positions.shape
    dev = q_positions.device
    q_live = q_positions >= 0
    qseg = q_segments.long()
    if not bool(q_live.any()):
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        minus = torch.full_like(k_positions, -1, dtype=torch.long)
        return Sequences(0, torch.full_like(qseg, -1), minus, empty)
    live_seg = qseg[q_live]
    lo, hi = int(live_seg.min()), int(live_seg.max())
    width = hi - lo + 1
    rows_q = torch.arange(B, device=dev)[:, None]
    key_q = rows_q * width + (qseg - lo)  # (B, Tq): one integer per (row, segment)
    uniq = torch.unique(key_q[q_live])  # sorted: sequences in (row, segment) order
    q_seq = torch.full((B, Tq), -1, dtype=torch.long, device=dev)
    q_seq[q_live] = torch.searchsorted(uniq, key_q[q_live])
    kseg = k_segments.long() - lo
    k_ok = (k_positions >= 0) & (kseg >= 0) & (kseg < width)
    key_k = torch.arange(B, device=dev)[:, None] * width + kseg.clamp(0, width - 1)
    idx = torch.searchsorted(uniq, key_k).clamp(max=uniq.numel() - 1)
    k_ok &= uniq[idx] == key_k
    k_seq = torch.where(k_ok, idx, -1)
    return Sequences(int(uniq.numel()), q_seq, k_seq, uniq // width)


def check_distinct_positions(q_positions: torch.Tensor, seqs: Sequences) -> None:
    """ValueError when one sequence holds the same query position twice."""
    live = seqs.q_seq >= 0
    key = seqs.q_seq[live] * (int(q_positions.max()) + 1) + q_positions[live].long()
    if torch.unique(key).numel() != key.numel():
        raise ValueError("q_positions: a sequence has the same position twice")


def sequence_lengths(q_positions: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """(count,) int64: positions each sequence's queries can see (its largest query position + 1)."""
    live = seqs.q_seq >= 0
    out = torch.zeros(seqs.count, dtype=torch.long, device=q_positions.device)
    return out.scatter_reduce_(0, seqs.q_seq[live], q_positions[live].long() + 1, "amax")
