"""A step's rollout-correction bookkeeping (`algorithm.rollout_correction`, docs/rollouts.md).

`StepCorrections` gives `train_step` what it needs in a few calls: each mini-batch's loss
normaliser over its micro-batches and every rank (`units`), each micro-batch's `Corrected`
for `micro_loss` (`take`), and the step's correction/* metrics (`metrics`).

A correction is always taken against the trainer's logprobs BEFORE the step's first update:
from the step's scoring pass (a no-grad forward before any backward) where one ran, else from
the micro-batch's first training forward (the first mini-batch of the first epoch), and kept
for every later epoch. Mask modes drop tokens, and a dropped token leaves its mini-batch's
denominator, so they need the scoring pass over every micro-batch; the other modes need it
over the mini-batches after the first (their training forwards come after an update). Each
micro-batch is counted in the metrics once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from rl_engine.algorithms import aggregation_units
from rl_engine.config import AlgorithmConfig, RunConfig
from rl_engine.exact.records import AllReduce, SequenceRecords
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.policy.parity_check import ParityCheck
from rl_engine.executors.worker.policy.step_loss import Corrected
from rl_engine.logprobs.parity import CorrectionSums, ParitySums, correction_sums


def needs_scoring_pass(algo: AlgorithmConfig, mini: int, decoupled: bool = False) -> bool:
    """Whether the correction of mini-batch `mini` needs the step's scoring pass (`decoupled`:
    an asynchronous run's decoupled PPO, which needs every proximal logprob)."""
    mode = algo.rollout_correction
    return mode.endswith("_mask") or ((mode != "none" or decoupled) and mini > 0)


@torch.no_grad()
def scoring_pass(
    minis: list[list[MicroBatch | None]],
    forward: Callable[[MicroBatch | None], torch.Tensor],
    parity: ParityCheck,
    config: RunConfig,
) -> tuple[dict[tuple[int, int], torch.Tensor], ParitySums]:
    """The no-grad forward of the mini-batches whose training forward comes after an update,
    where parity (`trainer.parity_scope: all`) or the rollout correction needs their
    pre-update logprobs; mask corrections need every mini-batch's. `forward(mb)`: the policy's
    (b, T-1) logprobs (every rank runs as many forwards: ZeRO-3). Returns (logprobs by
    (mini-batch, micro-batch), parity sums). Nothing to do with one mini-batch."""
    checks = parity.active and config.trainer.parity_scope == "all"
    decoupled = config.rollout.max_staleness > 0
    logps, sums = {}, parity.empty()
    for j, micro in enumerate(minis):
        if not ((checks and j > 0) or needs_scoring_pass(config.algorithm, j, decoupled)):
            continue
        for i, mb in enumerate(micro):
            logp = forward(mb)
            if mb is not None:
                logps[(j, i)] = logp
            if j > 0 and parity.active:  # checked here, not after an update
                sums = sums.merge(parity.check(mb, logp))
    return logps, sums


class StepCorrections:
    """One step's rollout corrections; build it inside the step, before any backward.

    `minis`: the step's mini-batches of micro-batches in the padded view (None: an empty
    micro-batch that only keeps this rank in step with the others); `scored`: the scoring
    pass's (b, T-1) fp32 logprobs by (mini-batch, micro-batch); `all_reduce`: the ranks' sum
    (every rank builds this object: the normalisers are a collective); `decoupled`: an
    asynchronous run's decoupled PPO, corrected under every mode ('none': the plain weight).
    """

    def __init__(
        self,
        algo: AlgorithmConfig,
        minis: list[list[TrainBatch | None]],
        scored: dict[tuple[int, int], torch.Tensor],
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
        all_gather: Callable[[object], list] | None = None,
        decoupled: bool = False,
    ):
        self.algo, self._all_gather, self._decoupled = algo, all_gather, decoupled
        # trainer.layout_invariant (all_gather given): one record per sequence, totalled
        # exactly, and each sequence's log-ratio summed exactly (sequence modes)
        self._exact = all_gather is not None
        self._sums = CorrectionSums() if all_gather is None else SequenceRecords(CorrectionSums)
        self._taken: dict[tuple[int, int], Corrected] = {}
        for key in sorted(scored):
            mb = minis[key[0]][key[1]]
            if mb is not None:
                self._count(key, mb, self._corrected(mb, scored[key]))
        self.units = self._mini_batch_units(minis, all_reduce)

    def _mini_batch_units(self, minis, all_reduce) -> list[float]:
        """Each mini-batch's loss normaliser over its micro-batches and every rank (mask modes:
        what is dropped is not counted); one all-reduce for all of them."""
        aggregation, masking = self.algo.loss_aggregation, self.algo.rollout_correction
        local = []
        for j, micro in enumerate(minis):
            units = 0.0
            for i, mb in enumerate(micro):
                if mb is None:
                    continue
                early = self._taken.get((j, i)) if masking.endswith("_mask") else None
                units += (
                    aggregation_units(mb.response_mask, aggregation)
                    if early is None
                    else early.units(aggregation)
                )
            local.append(units)
        # integer counts in fp64: exact in any order, so layout-invariant steps take them too
        total = all_reduce(torch.tensor(local, dtype=torch.float64))
        return [max(float(u), 1.0) for u in total]  # everything dropped: a zero loss, not 0 / 0

    def take(
        self, key: tuple[int, int], mb: TrainBatch, logp: torch.Tensor | None
    ) -> Corrected | None:
        """Micro-batch `key`'s correction for `micro_loss` (None under mode 'none').

        `logp`: its logprobs from a forward before the step's first update (counted in the
        metrics), or None for a forward after one (then the kept correction is used).
        """
        if key not in self._taken and logp is not None:
            self._count(key, mb, self._corrected(mb, logp.detach()))
        if self.algo.rollout_correction == "none" and not self._decoupled:
            return None
        if key not in self._taken:
            raise RuntimeError(f"no pre-update correction for micro-batch {key}")  # a worker bug
        return self._taken[key]

    def _corrected(self, mb: TrainBatch, logp: torch.Tensor) -> Corrected:
        return Corrected.of(self.algo, mb, logp, self._exact, self._decoupled)

    def _count(self, key, mb: TrainBatch, corrected: Corrected) -> None:
        self._taken[key] = corrected
        args = (corrected.proximal, mb.rollout_logprobs, mb.response_mask, corrected.correction)
        if self._all_gather is None:
            self._sums = self._sums.merge(correction_sums(*args))
            return
        rows = range(mb.response_mask.shape[0])  # each sequence's own tokens: its sums' bits
        records = tuple(correction_sums(*(_row(arg, r) for arg in args)) for r in rows)
        self._sums = self._sums.merge(SequenceRecords(CorrectionSums, records))

    def metrics(self, all_reduce: AllReduce) -> dict[str, float]:
        """correction/* over every rank (collective)."""
        if self._all_gather is not None:
            return self._sums.total(self._all_gather).metrics()
        return self._sums.all_reduce(all_reduce).metrics()


def _row(value, r: int):
    """Row r (kept 2-D) of a (B, T) tensor or of every tensor of a RolloutCorrection."""
    if isinstance(value, torch.Tensor):
        return value[r : r + 1]
    return dataclasses.replace(
        value, **{f.name: getattr(value, f.name)[r : r + 1] for f in dataclasses.fields(value)}
    )
