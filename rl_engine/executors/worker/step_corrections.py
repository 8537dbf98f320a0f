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

from collections.abc import Callable

import torch

from rl_engine.algorithms import aggregation_units
from rl_engine.config import AlgorithmConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.step_loss import Corrected
from rl_engine.parity import (
    correction_metrics,
    correction_sums,
    empty_correction_sums,
    merge_correction_sums,
    reduce_correction_sums,
)


def needs_scoring_pass(algo: AlgorithmConfig, mini: int) -> bool:
    """Whether the correction of mini-batch `mini` needs the step's scoring pass."""
    mode = algo.rollout_correction
    return mode.endswith("_mask") or (mode != "none" and mini > 0)


class StepCorrections:
    """One step's rollout corrections; build it inside the step, before any backward.

    `minis`: the step's mini-batches of micro-batches in the padded view (None: an empty
    micro-batch that only keeps this rank in step with the others); `scored`: the scoring
    pass's (b, T-1) fp32 logprobs by (mini-batch, micro-batch); `all_reduce`: the ranks' sum
    (every rank builds this object: the normalisers are a collective).
    """

    def __init__(
        self,
        algo: AlgorithmConfig,
        minis: list[list[TrainBatch | None]],
        scored: dict[tuple[int, int], torch.Tensor],
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.algo = algo
        self._sums = empty_correction_sums()
        self._taken: dict[tuple[int, int], Corrected] = {}
        for key in sorted(scored):
            mb = minis[key[0]][key[1]]
            if mb is not None:
                self._count(key, mb, Corrected.of(algo, mb, scored[key]))
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
            self._count(key, mb, Corrected.of(self.algo, mb, logp.detach()))
        if self.algo.rollout_correction == "none":
            return None
        if key not in self._taken:
            raise RuntimeError(f"no pre-update correction for micro-batch {key}")  # a worker bug
        return self._taken[key]

    def _count(self, key, mb: TrainBatch, corrected: Corrected) -> None:
        self._taken[key] = corrected
        self._sums = merge_correction_sums(
            self._sums,
            correction_sums(
                corrected.proximal, mb.rollout_logprobs, mb.response_mask, corrected.correction
            ),
        )

    def metrics(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """correction/* over every rank (collective)."""
        return correction_metrics(reduce_correction_sums(self._sums, all_reduce))
