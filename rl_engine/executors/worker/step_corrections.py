"""A step's rollout-correction bookkeeping (`algorithm.rollout_correction`, docs/rollouts.md).

`StepCorrections` gives `train_step` what it needs in a few calls: the loss
normaliser over every micro-batch and rank (`units`), each micro-batch's
`Corrected` for `micro_loss` (`take`), and the step's correction/* metrics
(`metrics`). Mask modes drop tokens, and a dropped token leaves the step's global
denominator, so their corrections come from a no-grad forward of every
micro-batch before the first backward; other modes take each micro-batch's
correction from its own forward.
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


class StepCorrections:
    """One step's rollout corrections; build it inside the step, before any backward.

    `micro`: the step's micro-batches in the padded view (None: an empty micro-batch that
    only keeps this rank in step with the others); `forward(index)`: micro-batch `index`'s
    (b, T-1) fp32 trainer logprobs (run for the empty ones too: under ZeRO-3 a forward is a
    collective); `all_reduce`: the ranks' sum (every rank builds this object: the
    normaliser is a collective).
    """

    def __init__(
        self,
        algo: AlgorithmConfig,
        micro: list[TrainBatch | None],
        forward: Callable[[int], torch.Tensor],
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.algo = algo
        self._early = self._before_backward(micro, forward)
        self.units = self._step_units(micro, all_reduce)
        self._sums = empty_correction_sums()

    def _before_backward(self, micro, forward) -> list[Corrected | None]:
        """Mask modes: every micro-batch's correction from a no-grad forward; else None each."""
        if not self.algo.rollout_correction.endswith("_mask"):
            return [None] * len(micro)
        early = []
        with torch.no_grad():
            for index, mb in enumerate(micro):
                logp = forward(index)
                early.append(None if mb is None else Corrected.of(self.algo, mb, logp))
        return early

    def _step_units(self, micro, all_reduce) -> float:
        """The loss normaliser over every micro-batch and rank (what is dropped is not counted)."""
        aggregation = self.algo.loss_aggregation
        local = sum(
            aggregation_units(mb.response_mask, aggregation) if c is None else c.units(aggregation)
            for mb, c in zip(micro, self._early)
            if mb is not None
        )
        units = float(all_reduce(torch.tensor([local], dtype=torch.float64))[0])
        return max(units, 1.0)  # everything dropped: a zero loss, not 0 / 0

    def take(self, index: int, mb: TrainBatch, logp: torch.Tensor) -> Corrected | None:
        """Micro-batch `index`'s correction for `micro_loss` (None under mode 'none'), counted in the metrics.

        `logp`: its logprobs from the step's first forward (used unless a mask mode computed
        the correction before the backward).
        """
        corrected = self._early[index] or Corrected.of(self.algo, mb, logp.detach())
        self._sums = merge_correction_sums(
            self._sums,
            correction_sums(
                corrected.proximal, mb.rollout_logprobs, mb.response_mask, corrected.correction
            ),
        )
        return None if self.algo.rollout_correction == "none" else corrected

    def metrics(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """correction/* over every rank (collective)."""
        return correction_metrics(reduce_correction_sums(self._sums, all_reduce))
