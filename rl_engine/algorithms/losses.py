"""Policy-gradient losses for GRPO/PPO on token sequences, plus KL and importance fixes.

Pure torch functions over `[B, T]` per-token tensors; every function that reduces
takes the validity mask explicitly (1 = completion token, 0 = prompt or padding)
and does its math in fp32. Values at masked positions are never read into a
result or a gradient: padded logprobs may hold anything, even inf.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rl_engine.exact.float_sums import exact_row_means

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_LEVELS = ("token", "sequence")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is nonzero (fp32).

    With `dim=None` the mean is over all selected positions and an empty mask is a
    ValueError. With `dim` given, a slice that selects nothing gives 0.
    """
    _check_same_shape("x", x, "mask", mask)
    keep = mask != 0
    total = torch.where(keep, x.float(), 0.0).sum(dim=dim)
    count = keep.sum(dim=dim)
    if dim is None:
        if int(count) == 0:
            raise ValueError("mask selects no tokens: cannot take a masked mean")
        return total / count
    return total / count.clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = "token-mean",
    is_weights: Tensor | None = None,
    ratio_level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate loss `-min(r*A, clip(r, 1-eps, 1+eps_high)*A)`.

    `ratio_level="token"`: `r_t = exp(logprobs_t - old_logprobs_t)` per token (PPO, GRPO).
    `ratio_level="sequence"` (GSPO, Zheng et al. 2025): every token of sequence i uses
    `s_i = exp(mean_t(logprobs_t - old_logprobs_t))` over its valid tokens, the
    length-normalised sequence ratio, clipped as a whole; its gradient is
    `s_i * grad mean_t(logprobs_t)` (the token form `exp(logp_t - sg(logp_t) + sg(log s_i))`).
    GSPO averages per sequence: pair it with aggregation "seq-mean-token-mean".
    Gradients flow only through `logprobs`.
    `advantages` is `[B]` (one per sequence, broadcast over its tokens) or `[B, T]`.
    `clip_eps_high` defaults to `clip_eps` (set it higher for DAPO's clip-higher).
    `is_weights` (`[B, T]`, e.g. `rollout_correction(...).weights`) multiply the
    per-token loss and are treated as constants.

    aggregation:
    - "token-mean": sum over all valid tokens / number of valid tokens;
    - "seq-mean-token-mean": mean per sequence, then mean over the sequences that
      have at least one valid token;
    - "seq-mean-token-sum": sum per sequence, then mean over all B sequences.

    Returns `(loss, stats)`; stats are detached 0-d fp32 tensors (no device sync):
    clip_fraction (valid tokens whose clipped term is the active minimum),
    approx_kl (mean of old - new), ratio_mean and ratio_max over valid tokens.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
    terms = policy_loss_terms(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        is_weights=is_weights,
        ratio_level=ratio_level,
    )
    keep = mask != 0
    loss = aggregate(terms.per_token, keep, aggregation)
    stats = _policy_stats(terms.log_ratio, terms.ratio, terms.clipped, keep)
    return loss, stats


class PolicyTerms(NamedTuple):
    """The clipped surrogate token by token, before any aggregation (all [B, T] fp32)."""

    per_token: Tensor
    """-min(r A, clip(r) A) (times the importance weights), 0 off the mask; carries the gradient."""
    log_ratio: Tensor
    ratio: Tensor
    clipped: Tensor
    """bool: the clipped term is the active minimum (on the mask only)."""


def policy_loss_terms(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_weights: Tensor | None = None,
    ratio_level: str = "token",
    exact_sequences: bool = False,
) -> PolicyTerms:
    """`policy_loss`'s per-token terms (see it for the arguments). With ratio_level "token"
    each token's terms are elementwise functions of that token's values alone; with
    "sequence" and `exact_sequences` (trainer.layout_invariant) the sequence's mean log-ratio
    is its exact sum (`exact_row_means`), so its bits depend on the sequence alone."""
    _check_2d("logprobs", logprobs)
    _check_same_shape("logprobs", logprobs, "old_logprobs", old_logprobs)
    _check_same_shape("logprobs", logprobs, "mask", mask)
    adv = _broadcast_advantages(advantages, logprobs)
    if is_weights is not None:
        _check_same_shape("logprobs", logprobs, "is_weights", is_weights)
    eps_low, eps_high = _clip_range(clip_eps, clip_eps_high)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {list(RATIO_LEVELS)}")

    keep = mask != 0
    # Zero the log-ratio at padding before exp so garbage there cannot overflow
    # (an inf in the forward would become a NaN gradient even where masked).
    log_ratio = torch.where(keep, logprobs.float() - old_logprobs.detach().float(), 0.0)
    if ratio_level == "sequence":
        logp = torch.where(keep, logprobs.float(), 0.0)
        log_ratio = _sequence_log_ratio(log_ratio, logp, keep, exact_sequences)
    ratio = torch.exp(log_ratio)
    surr_unclipped = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(surr_unclipped, surr_clipped)
    if is_weights is not None:
        per_token = per_token * torch.where(keep, is_weights.detach().float(), 0.0)

    per_token = torch.where(keep, per_token, 0.0)
    clipped = (surr_clipped < surr_unclipped) & keep
    return PolicyTerms(per_token, log_ratio, ratio, clipped)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Per-token k3 estimator of KL(policy || ref): `exp(ref - logp) - (ref - logp) - 1`.

    Unbiased for samples drawn from the policy and always >= 0 (Schulman,
    "Approximating KL divergence"). Computed as `expm1(d) - d` for accuracy when
    the two are close. Where `mask` is given and 0 the result is 0. fp32, `[B, T]`.
    """
    _check_same_shape("logprobs", logprobs, "ref_logprobs", ref_logprobs)
    diff = ref_logprobs.float() - logprobs.float()
    if mask is not None:
        _check_same_shape("logprobs", logprobs, "mask", mask)
        diff = torch.where(mask != 0, diff, 0.0)
    # clamp: rounding can make expm1(d) - d a hair negative for |d| near 1 ulp.
    return (torch.expm1(diff) - diff).clamp(min=0.0)


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """Reduce `[B, T]` per-token values to a scalar the way `aggregation` says (see `policy_loss`)."""
    keep = mask != 0
    masked = torch.where(keep, per_token, 0.0)
    if aggregation == "seq-mean-token-sum":
        return masked.sum(dim=1).mean()
    if not bool(keep.any()):
        raise ValueError(
            f"mask selects no tokens: aggregation {aggregation!r} has nothing to average"
        )
    if aggregation == "token-mean":
        return masked.sum() / keep.sum()
    # seq-mean-token-mean: sequences with no valid tokens do not dilute the mean.
    counts = keep.sum(dim=1)
    nonempty = counts > 0
    seq_means = masked.sum(dim=1)[nonempty] / counts[nonempty]
    return seq_means.mean()


def aggregation_units(mask: Tensor, aggregation: str) -> float:
    """The denominator `aggregate` divides by for `mask`: tokens, non-empty sequences or sequences.

    A batch split into parts has loss = sum over parts of aggregate(part) x units(part) /
    units(whole), which is how the trainer combines micro-batches and ranks.
    """
    keep = mask != 0
    if aggregation == "token-mean":
        return float(keep.sum())
    if aggregation == "seq-mean-token-mean":
        return float((keep.sum(dim=1) > 0).sum())
    if aggregation == "seq-mean-token-sum":
        return float(mask.shape[0])
    raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")


def _sequence_log_ratio(log_ratio: Tensor, logprobs: Tensor, keep: Tensor, exact: bool) -> Tensor:
    """Per token: log s_i (the sequence's mean log-ratio) in value, grad of mean_t logp_t.

    The gradient reaches each token straight from its own term (no sum over the sequence in
    the backward); only the forward's mean is a reduction, exact when `exact`."""
    if exact:
        seq = exact_row_means(log_ratio, keep)
    else:
        counts = keep.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
        seq = log_ratio.sum(dim=1, keepdim=True) / counts  # (B, 1): log s_i
    return torch.where(keep, logprobs - logprobs.detach() + seq.detach(), 0.0)


@torch.no_grad()
def _policy_stats(
    log_ratio: Tensor, ratio: Tensor, clipped: Tensor, keep: Tensor
) -> dict[str, Tensor]:
    count = keep.sum().clamp(min=1)  # all-zero mask (token-sum) gives zero stats, not NaN
    ratio_max = torch.where(keep, ratio, 0.0).max() if bool(keep.any()) else ratio.new_ones(())
    return {
        "clip_fraction": clipped.sum().float() / count,
        "approx_kl": torch.where(keep, -log_ratio, 0.0).sum() / count,
        "ratio_mean": torch.where(keep, ratio, 0.0).sum() / count,
        "ratio_max": ratio_max.reshape(()),
    }


def _broadcast_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    batch = logprobs.shape[0]
    if advantages.shape == (batch,):
        return advantages.detach().float()[:, None]
    if advantages.shape == logprobs.shape:
        return advantages.detach().float()
    raise ValueError(
        f"advantages must be [B]={[batch]} or [B, T]={list(logprobs.shape)} like logprobs, "
        f"got advantages shape {list(advantages.shape)}"
    )


def _clip_range(clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    if not 0 <= clip_eps < 1:
        raise ValueError(f"clip_eps must be in [0, 1), got {clip_eps}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not eps_high >= 0:
        raise ValueError(f"clip_eps_high must be >= 0, got {clip_eps_high}")
    return clip_eps, eps_high


def _check_2d(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {list(x.shape)}")


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"shape mismatch: {name_a} has shape {list(a.shape)} "
            f"but {name_b} has shape {list(b.shape)}"
        )
