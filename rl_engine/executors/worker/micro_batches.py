"""A rank's shard as the step's micro-batches: which sequences share one, padded or packed.

Layouts, by `trainer.packing` and `trainer.max_tokens_per_micro_batch` (N):

| packing | N | a micro-batch                                                        |
|---------|---|----------------------------------------------------------------------|
| false   | 0 | micro_batch_size consecutive rows, as wide as the shard (the baseline) |
| false   | N | a planned group (count x longest <= N), right-padded to its longest  |
| true    | 0 | micro_batch_size consecutive sequences, concatenated in one row       |
| true    | N | a planned group (sum of lengths <= N), concatenated in one row        |

Groups come from `rl_engine.logprobs.packing.plan_micro_batches`: the lengths alone decide
them, so a resumed run groups the same way. Whatever the layout, `MicroBatch.batch`
is the padded view (b, T) of its sequences that the loss, the parity check and
the rollout correction read; with packing the forward runs on `packed` and its
logprobs are moved back to that view (`MicroBatch.logprobs_view`), bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.logprobs import IGNORE_INDEX
from rl_engine.logprobs.packing import PackedBatch, plan_micro_batches


@dataclass
class MicroBatch:
    """One forward/backward of a step (see the module docstring)."""

    batch: TrainBatch
    """Its sequences, padded layout: (b, T) and (b, T-1) tensors."""
    sequences: tuple[int, ...]
    """Their rows in the rank's shard, in order."""
    packed: PackedBatch | None = None
    """The same sequences concatenated in one row (packing), else None."""

    def targets(self) -> torch.Tensor:
        """What the forward scores: (b, T-1) padded, or (1, N) packed; IGNORE_INDEX off the mask."""
        b = self.batch
        targets = torch.where(b.response_mask, b.input_ids[:, 1:], IGNORE_INDEX)
        return targets if self.packed is None else self.packed.pack_values(targets, IGNORE_INDEX)

    def logprobs_view(self, logp: torch.Tensor) -> torch.Tensor:
        """The forward's logprobs in the padded view (b, T-1) (packed: moved, differentiably)."""
        return logp if self.packed is None else self.packed.unpack_values(logp)


class MicroSlot(NamedTuple):
    """Where a training forward sits in the step: epoch, mini-batch, micro-batch."""

    epoch: int
    mini: int
    micro: int


def plan(
    batch: TrainBatch,
    *,
    micro_batch_size: int,
    max_tokens: int,
    packing: bool,
    consecutive: bool = False,
) -> list[MicroBatch]:
    """The micro-batches of `batch` (already on its device); ValueError for a too-long sequence.
    `consecutive` (layout-invariant training): each a run of consecutive sequences."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    groups = plan_micro_batches(
        lengths,
        max_sequences=micro_batch_size,
        max_tokens=max_tokens,
        padded=not packing,
        consecutive=consecutive,
    )
    if not packing and not max_tokens:  # the baseline: row slices, full width
        return [MicroBatch(batch._rows(slice(g[0], g[-1] + 1)), tuple(g)) for g in groups]
    micro = []
    for group in groups:
        rows = torch.tensor(group, device=batch.input_ids.device)
        sub = _trimmed(batch._index(rows))
        packed = PackedBatch.from_padded(sub.input_ids, sub.attention_mask) if packing else None
        micro.append(MicroBatch(sub, tuple(group), packed))
    return micro


def _trimmed(batch: TrainBatch) -> TrainBatch:
    """`batch` without the columns past its last real token (padding only: no bits change)."""
    live = batch.attention_mask.any(dim=0).nonzero()
    width = max(int(live[-1]) + 1, 2) if live.numel() else 2
    return batch._columns(width)
