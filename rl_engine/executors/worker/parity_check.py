"""The worker's parity check: a micro-batch's trainer logprobs against the rollout's.

`config.parity` decides what a check does. 'off': nothing is compared and the step reports
no parity/* metrics. 'report': the micro-batch's `ParitySums` join the step's parity/*
metrics (`rl_engine.logprobs.parity`: one definition for the worker and the diagnostics). 'strict':
also, before the micro-batch's backward, the ranks all-reduce its mismatch count, and a
mismatch on any rank raises ParityError on every rank, so no update is taken and no rank is
left waiting in a collective. The worker checks forwards of the pre-update policy only
(`trainer.parity_scope`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.errors import parity_error
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.logprobs.parity import MismatchMetrics, ParitySums, parity_sums
from rl_engine.exact.records import SequenceRecords


@dataclass(frozen=True, slots=True)
class ParityCheck:
    """One rank's parity checks under `mode` ('off' | 'report' | 'strict')."""

    mode: str
    comm: Collectives
    per_sequence: bool = False
    """trainer.layout_invariant: one record per sequence, totalled exactly (SequenceRecords)."""

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def empty(self) -> ParitySums | SequenceRecords:
        """What a step's parity sums start from."""
        return SequenceRecords(ParitySums) if self.per_sequence else ParitySums()

    def check(self, mb: MicroBatch | None, logp: torch.Tensor) -> ParitySums:
        """Parity sums of one micro-batch (b, T-1) logprobs; under 'strict' every rank raises on
        any mismatch (an empty micro-batch, None, adds nothing but takes part in that check's
        all-reduce)."""
        if not self.active or mb is None:
            sums = self.empty()
        else:
            sums = self._sums(logp, mb.batch)
        if not self.active:
            return sums
        if self.mode == "strict":
            count = torch.tensor([_mismatches(sums)], dtype=torch.float64)
            mismatches = int(self.comm.all_reduce(count)[0])
            if mismatches > 0:
                view, rows = (None, ()) if mb is None else (mb.batch, mb.sequences)
                raise parity_error(self.comm.rank, logp, view, rows, mismatches)
        return sums

    def _sums(self, logp: torch.Tensor, batch) -> ParitySums | SequenceRecords:
        rollout, mask = batch.rollout_logprobs, batch.response_mask
        if not self.per_sequence:
            return parity_sums(logp, rollout, mask)
        rows = range(logp.shape[0])  # a sequence's own tokens, a fresh tensor: its sums' bits
        return SequenceRecords(
            ParitySums, tuple(parity_sums(logp[r], rollout[r], mask[r]) for r in rows)
        )

    def metrics(self, sums: ParitySums | SequenceRecords) -> MismatchMetrics | None:
        """The step's mismatch metrics over every rank (collective), None under 'off'."""
        if not self.active:
            return None
        if isinstance(sums, SequenceRecords):
            return MismatchMetrics.from_sums(sums.total(self.comm.all_gather))
        return MismatchMetrics.from_sums(sums.all_reduce(self.comm.all_reduce))


def _mismatches(sums: ParitySums | SequenceRecords) -> float:
    if isinstance(sums, SequenceRecords):
        return sum(record.mismatches for record in sums.records)
    return sums.mismatches
