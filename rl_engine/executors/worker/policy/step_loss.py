"""The arithmetic of one training step: each micro-batch's loss and the step's metrics.

Micro-batches and ranks hold unequal token counts, yet the step must minimise the
loss of the whole batch: each micro-batch's aggregated loss is weighted by its share
of the global normaliser (`aggregation_units`), then multiplied by DeepSpeed's
gradient_accumulation_steps x world_size to undo DeepSpeed's own averaging. So
`token-mean` is over all the step's valid tokens and the seq-mean modes over its
sequences, however the sequences were split into micro-batches (or packed).

Rollout correction (`algorithm.rollout_correction`, docs/rollouts.md): with a mode
other than 'none', or in an asynchronous run (decoupled PPO), the PPO ratio is taken
against the trainer's own logprobs before the update (`Corrected.proximal`) and the
correction's weights carry the engine mismatch (and an asynchronous run's policy lag); tokens the correction drops leave the loss mask, and sequences left
with no token leave the micro-batch, so both leave every aggregation's
denominator. With 'none' the ratio is against the rollout's logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.algorithms import (
    RolloutCorrection,
    aggregate,
    aggregation_units,
    kl_k3,
    policy_loss,
    rollout_correction,
)
from rl_engine.config import AlgorithmConfig
from rl_engine.exact.records import Sums
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.logprobs.parity import MismatchMetrics


@dataclass(frozen=True, slots=True)
class LossSums(Sums):
    """A micro-batch's loss terms and token counts, summed over the step's micro-batches,
    updates and ranks (`step_metrics` reads them)."""

    loss: float = 0.0
    """Its share of its mini-batch's loss: (policy loss + kl_coef x kl) x share."""
    policy_loss: float = 0.0
    """Its share of its mini-batch's policy loss."""
    clipped: float = 0.0
    """Completion tokens whose ratio was clipped."""
    kl: float = 0.0
    """Its share of its mini-batch's k3 KL to the reference policy."""
    neg_logp: float = 0.0
    """Minus the sum of its completion tokens' logprobs (the entropy estimate)."""
    tokens: float = 0.0
    """Its completion tokens (response_mask), counted at every forward that scores them: a
    count, always finite, so `finite()` asks whether every loss term is."""


@dataclass(frozen=True)
class Corrected:
    """One micro-batch under rollout correction: what the correction did, and the PPO ratio's old logprobs."""

    correction: RolloutCorrection
    proximal: torch.Tensor
    """(b, T-1) fp32 trainer logprobs before the update (detached)."""

    @classmethod
    def of(
        cls,
        algo: AlgorithmConfig,
        mb: TrainBatch,
        trainer_logp: torch.Tensor,
        exact: bool = False,
        decoupled: bool = False,
    ) -> Corrected:
        """`exact`: sequence modes sum each sequence's log-ratio exactly (layout_invariant);
        `decoupled`: decoupled PPO (asynchronous RL), where mode 'none' weighs each token by
        its plain proximal/behaviour ratio."""
        correction = rollout_correction(
            trainer_logp,
            mb.rollout_logprobs,
            mb.response_mask,
            mode=algo.rollout_correction,
            threshold=algo.correction_threshold,
            exact=exact,
            decoupled=decoupled,
        )
        return cls(correction, trainer_logp.detach())

    @property
    def rows(self) -> torch.Tensor:
        """(b,) bool: sequences that stay in the micro-batch (all but those the correction emptied)."""
        c = self.correction
        return ~(c.dropped.any(dim=1) & ~c.mask.any(dim=1))

    def units(self, aggregation: str) -> float:
        """This micro-batch's share of the step's normaliser once dropped tokens and sequences left it."""
        return aggregation_units(self.correction.mask[self.rows], aggregation)


def micro_loss(
    algo: AlgorithmConfig,
    mb: TrainBatch,
    logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    units: float,
    scale: int,
    corrected: Corrected | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """(loss to backpropagate, its LossSums) of one micro-batch.

    `units`: the global normaliser of the step; `scale`: DeepSpeed's gradient_accumulation_steps x world_size;
    `corrected`: None without rollout correction (mode 'none').
    """
    mask = mb.response_mask
    old, weights, loss_mask, rows = mb.rollout_logprobs, None, mask, slice(None)
    if corrected is not None:
        old, weights = corrected.proximal, corrected.correction.weights
        loss_mask, rows = corrected.correction.mask, corrected.rows
    logp_kept, loss_mask = logp[rows], loss_mask[rows]
    pg, clipped, kl = logp.sum() * 0.0, logp.new_zeros(()), logp.new_zeros(())
    if bool(loss_mask.any()):  # else every token was dropped: a zero loss, still on the graph
        pg, stats = policy_loss(
            logp_kept,
            old[rows],
            mb.advantages[rows],
            loss_mask,
            clip_eps=algo.clip_eps,
            clip_eps_high=algo.clip_eps_high,
            aggregation=algo.loss_aggregation,
            is_weights=None if weights is None else weights[rows],
            ratio_level=algo.ratio_level,
        )
        clipped = stats["clip_fraction"] * loss_mask.sum()
        if ref_logp is not None:
            per_token = kl_k3(logp_kept, ref_logp[rows], mask=loss_mask)
            kl = aggregate(per_token, loss_mask, algo.loss_aggregation)
    share = aggregation_units(loss_mask, algo.loss_aggregation) / units
    loss = (pg + algo.kl_coef * kl) * share
    record = LossSums.from_tensors(
        loss=loss,
        policy_loss=pg * share,
        clipped=clipped,
        kl=kl * share,
        neg_logp=-logp[mask].sum(),
        tokens=mask.sum(),
    )
    return loss * scale, record


def step_metrics(
    sums: LossSums,
    parity: MismatchMetrics | None,
    skipped: int,
    *,
    updates: int = 1,
    epochs: int = 1,
    **extra,
) -> dict[str, float]:
    """The step's metrics from the all-reduced sums over its `updates` optimizer steps
    and `epochs` passes (see `train_step`): loss terms are means over the updates, per-token
    figures over every training forward's tokens, `tokens` those of the batch."""
    tokens, steps = max(sums.tokens, 1.0), max(updates, 1)  # 0 updates: a warm-up step
    metrics = {
        "loss": sums.loss / steps,
        "policy_loss": sums.policy_loss / steps,
        "clip_fraction": sums.clipped / tokens,
        "kl": sums.kl / steps,
        "entropy": sums.neg_logp / tokens,
        "tokens": int(sums.tokens) // epochs,
        **extra,
        "updates": int(updates),
        "skipped_update": int(skipped),
    }
    if skipped:
        metrics["skip_reason"] = "non-finite gradient" if sums.finite() else "non-finite loss"
    if parity is not None:
        metrics.update(parity.step_metrics())
    return metrics


def summary(m: dict) -> str:
    """One log line of a step's metrics."""
    parity = ""
    if "parity/num_tokens" in m:
        exact, diff = m["parity/exact_match_fraction"], m["parity/max_abs_diff"]
        parity = f" | parity exact {exact:.4f} max|d| {diff:.2e}"
    skipped = f" | SKIPPED ({m['skip_reason']})" if m["skipped_update"] else ""
    return (
        f"step {m['step']}: loss {m['loss']:+.5f} pg {m['policy_loss']:+.5f} kl {m['kl']:.2e} "
        f"clip {m['clip_fraction']:.3f} grad_norm {m['grad_norm']:.3e} tokens {m['tokens']}"
        f"{parity}{skipped}"
    )
