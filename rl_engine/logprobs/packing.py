"""Packed sequences: several sequences concatenated in one row, no padding between them.

Layout (S sequences in R rows of N columns; a row's sequences one after another,
right padding after the last one):

    input_ids   (R, N)  int64  the sequences' tokens, `pad_id` after a row's last sequence
    positions   (R, N)  int64  each token's position in its own sequence (0, 1, ...), -1 = padding
    segments    (R, N)  int64  the sequence's index (0..S-1) on its tokens, -1 on padding

A packed forward (`rl_engine.logprobs.packed_score_targets`) gives each token the
bits it gets in a right-padded batch: every invariant op is row-wise, and
attention is segment-aware (rl_engine/kernels, docs/ops/attention.md). Column
maps (`pack_values` / `unpack_values`) move per-token values between the
padded layout (B, T-1) (position t scores token t+1, `rl_engine.logprobs`) and
the packed one, so both score exactly the same (context, target) pairs.

`plan_micro_batches` decides which sequences share a micro-batch: a function of
the lengths alone (so a resumed run plans the same micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated into rows (see the module docstring)."""

    input_ids: torch.Tensor
    """(R, N) int64."""
    positions: torch.Tensor
    """(R, N) int64, -1 = padding."""
    segments: torch.Tensor
    """(R, N) int64: sequence index, -1 = padding."""
    columns: torch.Tensor
    """(S, T) int64: for each column of the padded layout the flat index (row * N + column)
    of that token in the packed rows, -1 on padding."""

    @property
    def num_tokens(self) -> int:
        return int((self.positions >= 0).sum())

    def to(self, device) -> PackedBatch:
        return PackedBatch(*(t.to(device) for t in self._tensors()))

    def _tensors(self):
        return (self.input_ids, self.positions, self.segments, self.columns)

    @classmethod
    def from_padded(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: Sequence[int] | None = None,
        *,
        pad_id: int = 0,
    ) -> PackedBatch:
        """Pack the real tokens (attention_mask == 1) of each row of a (S, T) batch.

        rows[i]: the packed row of sequence i (default: all in row 0); a row holds its
        sequences in index order. A sequence's positions are its real tokens counted
        from 0, as in the padded forward (`positions_from_attention_mask`).
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must be (S, T) of one shape, got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        S = input_ids.shape[0]
        rows_t = torch.zeros(S, dtype=torch.long) if rows is None else torch.as_tensor(rows)
        if rows_t.shape != (S,) or (S and int(rows_t.min()) < 0):
            raise ValueError(f"rows must give one row >= 0 for each of the {S} sequences")
        live = attention_mask.bool()
        lengths = live.sum(1).cpu()  # (S,)
        R = int(rows_t.max()) + 1 if S else 1
        start = torch.zeros(S, dtype=torch.long)
        fill = [0] * R
        for i, (r, n) in enumerate(zip(rows_t.tolist(), lengths.tolist())):
            start[i], fill[r] = fill[r], fill[r] + n
        N = max(max(fill), 1)
        dev = input_ids.device
        pos = live.long().cumsum(1) - 1  # (S, T) position of each real token
        flat = rows_t.to(dev)[:, None] * N + start.to(dev)[:, None] + pos
        columns = torch.where(live, flat, -1)
        ids = torch.full((R * N,), pad_id, dtype=torch.long, device=dev)
        positions = torch.full((R * N,), -1, dtype=torch.long, device=dev)
        segments = torch.full((R * N,), -1, dtype=torch.long, device=dev)
        ids[columns[live]] = input_ids[live]
        positions[columns[live]] = pos[live]
        seq_index = torch.arange(S, device=dev)[:, None].expand(S, input_ids.shape[1])
        segments[columns[live]] = seq_index[live]
        shape = (R, N)
        return cls(ids.view(shape), positions.view(shape), segments.view(shape), columns)

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Sequence[int] | torch.Tensor], rows: Sequence[int] | None = None
    ) -> PackedBatch:
        """Pack token-id sequences (lists or 1-D tensors) into rows (see `from_padded`)."""
        return cls.from_padded(*right_padded(sequences), rows)

    def pack_values(self, values: torch.Tensor, fill) -> torch.Tensor:
        """(S, T-1) per-position values of the padded layout -> (R, N); `fill` elsewhere."""
        cols = self.columns[:, :-1]
        if values.shape != cols.shape:
            raise ValueError(
                f"values must be (S, T-1) = {tuple(cols.shape)}, got {tuple(values.shape)}"
            )
        out = torch.full((self.input_ids.numel(),), fill, dtype=values.dtype, device=values.device)
        keep = cols >= 0
        out[cols[keep]] = values[keep]
        return out.view(self.input_ids.shape)

    def unpack_values(self, packed: torch.Tensor) -> torch.Tensor:
        """(R, N) values of the packed rows -> (S, T-1) padded layout, 0 on padding (differentiable)."""
        cols = self.columns[:, :-1]
        flat = torch.cat([packed.reshape(-1), packed.new_zeros(1)])  # the last entry: padding's 0
        return flat[torch.where(cols >= 0, cols, flat.numel() - 1)]


def right_padded(sequences: Sequence[Sequence[int] | torch.Tensor]):
    """(input_ids (S, T), attention_mask (S, T)) int64 of token-id sequences, right-padded with 0."""
    ids = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not ids or any(t.numel() == 0 for t in ids):
        raise ValueError("need at least one sequence, none of them empty")
    T = max(t.numel() for t in ids)
    padded = torch.zeros(len(ids), T, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.long)
    for i, t in enumerate(ids):
        padded[i, : t.numel()], mask[i, : t.numel()] = t, 1
    return padded, mask


# ----------------------------------------------------------------------------- micro-batch plans


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    max_sequences: int,
    max_tokens: int = 0,
    padded: bool = False,
    consecutive: bool = False,
) -> list[list[int]]:
    """Which sequences (indices into `lengths`) go into each micro-batch.

    max_tokens 0: consecutive runs of max_sequences sequences (the last may be shorter).
    max_tokens N > 0: the fewest micro-batches with at most max_sequences sequences and at
    most N tokens each (packed: the sum of their lengths; padded: their count x the longest
    one), balanced: sequences longest first (ties by index) each go to the micro-batch
    with the fewest tokens that still has room, for the smallest micro-batch count at which
    that fits. A function of the lengths alone; micro-batches come in that order, each
    holding its sequences in index order. A sequence longer than N raises ValueError.
    consecutive: each micro-batch the longest run of consecutive sequences from where the last
    one ended that fits both limits (layout-invariant training sums per-sequence gradients in
    sequence order, so a micro-batch must be a contiguous range).
    """
    n = len(lengths)
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    if max_tokens == 0:
        return [list(range(s, min(s + max_sequences, n))) for s in range(0, n, max_sequences)]
    too_long = [(i, m) for i, m in enumerate(lengths) if m > max_tokens]
    if too_long:
        i, m = max(too_long, key=lambda e: e[1])
        raise ValueError(
            f"sequence {i} has {m} tokens, more than the token budget of {max_tokens} per "
            "micro-batch; raise the budget to at least the longest prompt + completion"
        )
    if consecutive:
        return _consecutive_runs(lengths, max_sequences, max_tokens, padded)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    low = max(math.ceil(sum(lengths) / max_tokens), math.ceil(n / max_sequences), 1)
    for count in range(low, n + 1):
        bins = _fill_bins(order, lengths, count, max_sequences, max_tokens, padded)
        if bins is not None:
            return [sorted(b) for b in bins if b]
    raise AssertionError(
        "unreachable: one sequence per micro-batch always fits"
    )  # pragma: no cover


def _consecutive_runs(lengths, max_sequences, max_tokens, padded) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, length in enumerate(lengths):
        run = runs[-1] if runs else None
        if run is not None and len(run) < max_sequences:
            cost = (
                (len(run) + 1) * max(length, *(lengths[j] for j in run))
                if padded
                else sum(lengths[j] for j in run) + length
            )
            if cost <= max_tokens:
                run.append(i)
                continue
        runs.append([i])
    return runs


def _fill_bins(order, lengths, count, max_sequences, max_tokens, padded):
    """Longest first into the least-loaded bin with room; None when some sequence finds none."""
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count  # tokens, or padded tokens
    for i in order:
        best = None
        for b in range(count):
            if len(bins[b]) >= max_sequences:
                continue
            # sorted longest first: a padded bin's longest is its first sequence
            cost = (
                (len(bins[b]) + 1) * (lengths[bins[b][0]] if bins[b] else lengths[i])
                if padded
                else load[b] + lengths[i]
            )
            if cost <= max_tokens and (best is None or load[b] < load[best]):
                best = b
        if best is None:
            return None
        bins[best].append(i)
        longest = lengths[bins[best][0]]
        load[best] = len(bins[best]) * longest if padded else load[best] + lengths[i]
    return bins
