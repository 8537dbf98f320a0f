"""The arithmetic of one training step: each micro-batch's loss and the step's metrics.

Micro-batches and ranks hold unequal token counts, yet the step must minimise the
loss of the whole batch: each micro-batch's aggregated loss is weighted by its share
of the global normaliser (`aggregation_units`), then multiplied by
gradient_accumulation_steps x world_size to undo DeepSpeed's own averaging.
"""

from __future__ import annotations

import torch

from rl_engine.algorithms import (
    aggregate,
    aggregation_units,
    kl_k3,
    policy_loss,
    truncated_importance_weights,
)
from rl_engine.config import AlgorithmConfig
from rl_engine.executors.batch import TrainBatch
from rl_engine.parity import MismatchMetrics

# entries of a micro-batch's record; summed over micro-batches and ranks
LOSS, POLICY_LOSS, CLIPPED, KL, NEG_LOGP, TOKENS = range(6)
RECORD_SIZE = 6


def micro_loss(
    algo: AlgorithmConfig,
    mb: TrainBatch,
    logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    units: float,
    scale: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, record (6,) fp64 CPU) of one micro-batch.

    `units`: the global normaliser of the step; `scale`: gradient_accumulation_steps x world_size.
    """
    mask = mb.response_mask
    is_weights = None
    if algo.tis_cap is not None:
        is_weights = truncated_importance_weights(
            logp.detach(), mb.rollout_logprobs, mask, cap=algo.tis_cap
        )
    pg, stats = policy_loss(
        logp,
        mb.rollout_logprobs,
        mb.advantages,
        mask,
        clip_eps=algo.clip_eps,
        clip_eps_high=algo.clip_eps_high,
        aggregation=algo.loss_aggregation,
        is_weights=is_weights,
    )
    kl = logp.new_zeros(())
    if ref_logp is not None:
        kl = aggregate(kl_k3(logp, ref_logp, mask=mask), mask, algo.loss_aggregation)
    share = aggregation_units(mask, algo.loss_aggregation) / units
    loss = (pg + algo.kl_coef * kl) * share
    tokens = mask.sum()
    record = [
        loss,
        pg * share,
        stats["clip_fraction"] * tokens,
        kl * share,
        -logp[mask].sum(),
        tokens,
    ]
    record = torch.stack([v.detach().double() for v in record]).cpu()
    return loss * scale, record


def step_metrics(
    sums: torch.Tensor, parity: MismatchMetrics | None, skipped: bool, **extra
) -> dict[str, float]:
    """The step's metrics from the all-reduced record sums (see `train_step`)."""
    tokens = max(float(sums[TOKENS]), 1.0)
    metrics = {
        "loss": float(sums[LOSS]),
        "policy_loss": float(sums[POLICY_LOSS]),
        "clip_fraction": float(sums[CLIPPED]) / tokens,
        "kl": float(sums[KL]),
        "entropy": float(sums[NEG_LOGP]) / tokens,
        "tokens": int(sums[TOKENS]),
        **extra,
        "skipped_update": int(skipped),
    }
    if skipped:
        finite_loss = bool(torch.isfinite(sums[:TOKENS]).all())
        metrics["skip_reason"] = "non-finite gradient" if finite_loss else "non-finite loss"
    if parity is not None:
        metrics.update(parity.step_metrics())
    return metrics


def grad_norm(module: torch.nn.Module) -> float:
    """The global L2 norm of the gradients held in `.grad` (fp64)."""
    norms = [
        torch.linalg.vector_norm(p.grad.double()) for p in module.parameters() if p.grad is not None
    ]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


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
