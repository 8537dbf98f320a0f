"""Rollout correction: importance weights for tokens sampled by an engine the trainer does not match.

The rollout engine drew each token from its own distribution p_rollout; the trainer
computes p_trainer. When the two differ (invariance off, or a foreign engine),
the policy gradient is off-policy by the importance ratio

    token ratio     r_t = exp(trainer_t - rollout_t)
    sequence ratio  R   = exp(sum_t (trainer_t - rollout_t))   over the sequence's tokens

and a correction with threshold C (> 1) bounds its variance:

- `none`: weight 1 (no correction);
- `token_truncate`: weight min(r_t, C) (truncated importance sampling, TIS);
- `token_mask`: tokens with r_t outside [1/C, C] are dropped; kept tokens weigh r_t
  (masked importance sampling);
- `sequence_truncate`: every token of a sequence weighs min(R, C);
- `sequence_mask`: sequences with R outside [1/C, C] are dropped whole; kept ones weigh R.

Decoupled PPO (AReaL; asynchronous RL, `rollout.max_staleness` >= 1): the engine's logprobs
are the behaviour policy's, possibly versions old, and the trainer's pre-update ones the
proximal policy's; the PPO ratio is clipped around the proximal and every mode above weighs
the proximal/behaviour ratio. There `decoupled=True` makes `none` the plain, uncapped weight
r_t (AReaL's default) instead of 1.

A dropped token leaves the loss entirely: `RolloutCorrection.mask` is the loss
mask to use, so it leaves the aggregation's denominator (token count, or the
sequences that keep a token) as well as its numerator. Weights are detached fp32
and 0 off the mask. With bitwise parity every ratio is exactly 1 and every mode
is the identity. `exact=True` (trainer.layout_invariant): a sequence's log-ratio sum is
exact (`exact_row_sums`), so its bits do not depend on the row's padding or batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_engine.exact.float_sums import exact_row_sums

CORRECTION_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class RolloutCorrection:
    """What a correction did to one (B, T) batch of tokens."""

    weights: Tensor
    """(B, T) fp32, detached: importance weight of each kept token, 0 elsewhere."""
    mask: Tensor
    """(B, T) bool: tokens that stay in the loss (numerator and denominator)."""
    truncated: Tensor
    """(B, T) bool: kept tokens whose weight was capped at C."""
    dropped: Tensor
    """(B, T) bool: valid tokens the correction removed from the loss."""


def rollout_correction(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str,
    threshold: float = 2.0,
    exact: bool = False,
    decoupled: bool = False,
) -> RolloutCorrection:
    """The correction `mode` with threshold C = `threshold` over the tokens `mask` selects;
    `decoupled`: `none` weighs every token r_t (decoupled PPO's behaviour weight), not 1.

    trainer_logprobs / rollout_logprobs / mask: (B, T); values off the mask are never read.
    """
    _check(trainer_logprobs, rollout_logprobs, mask, mode, threshold)
    valid = mask != 0
    with torch.no_grad():
        # Zero the log-ratio off the mask before exp: padding may hold anything.
        log_ratio = torch.where(valid, trainer_logprobs.float() - rollout_logprobs.float(), 0.0)
        if mode.startswith("sequence_"):
            if exact:
                per_seq = exact_row_sums(log_ratio, valid)
            else:
                per_seq = log_ratio.double().sum(dim=1, keepdim=True)  # (B, 1): fp64, long sums
            log_ratio = per_seq.float().expand_as(log_ratio)
        ratio = torch.exp(log_ratio)
        kept = valid.clone()
        if mode.endswith("_mask"):
            kept &= (ratio >= 1.0 / threshold) & (ratio <= threshold)
        truncated = torch.zeros_like(valid)
        weights = torch.ones_like(ratio) if mode == "none" and not decoupled else ratio
        if mode.endswith("_truncate"):
            truncated = valid & (ratio > threshold)
            weights = ratio.clamp(max=threshold)
        weights = torch.where(kept, weights, 0.0)
    return RolloutCorrection(weights=weights, mask=kept, truncated=truncated, dropped=valid & ~kept)


def _check(trainer, rollout, mask, mode: str, threshold: float) -> None:
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction {mode!r}; valid: {list(CORRECTION_MODES)}")
    if not threshold > 1:
        raise ValueError(
            f"correction threshold must be > 1 (the band is [1/C, C]), got {threshold}"
        )
    if trainer.dim() != 2:
        raise ValueError(f"trainer_logprobs must be 2-D [B, T], got shape {list(trainer.shape)}")
    for name, other in (("rollout_logprobs", rollout), ("mask", mask)):
        if other.shape != trainer.shape:
            raise ValueError(
                f"shape mismatch: trainer_logprobs has shape {list(trainer.shape)} "
                f"but {name} has shape {list(other.shape)}"
            )
