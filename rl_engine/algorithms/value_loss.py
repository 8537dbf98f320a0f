"""PPO's clipped value loss (the critic's objective) and explained variance.

    V_clip = V_old + clip(V - V_old, -c, c)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

per completion token t, with R the GAE returns (advantages + V_old), V_old the values
of the rollout-time critic and c `critic.value_clip` (verl's cliprange_value,
OpenRLHF's value_clip). The max keeps the pessimistic of the two errors, so a value
that moved more than c from V_old toward the return gets no further gradient. The
0.5 is verl's. Aggregated as a token mean over the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss_terms(
    values: Tensor, returns: Tensor, old_values: Tensor, mask: Tensor, *, clip: float
) -> tuple[Tensor, Tensor]:
    """(per-token loss (B, T) fp32, per-token clipped flag (B, T) bool), both 0 off `mask`.

    clipped: the clipped error is the larger one (verl's vf_clipfrac counts these tokens).
    """
    for name, x in (("returns", returns), ("old_values", old_values), ("mask", mask)):
        if x.shape != values.shape:
            raise ValueError(
                f"{name} must be shaped like values {list(values.shape)}, got {list(x.shape)}"
            )
    if not clip > 0:
        raise ValueError(f"clip (critic.value_clip) must be > 0, got {clip}")
    keep = mask.bool()
    values, returns, old = values.float(), returns.float().detach(), old_values.float().detach()
    clipped_values = old + (values - old).clamp(-clip, clip)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    clipped = (clipped_error > unclipped_error) & keep
    return torch.where(keep, per_token, 0.0), clipped


def clipped_value_loss(
    values: Tensor, returns: Tensor, old_values: Tensor, mask: Tensor, *, clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """(token-mean clipped value loss, {"clip_fraction"}) over `mask` (see the module docstring)."""
    per_token, clipped = value_loss_terms(values, returns, old_values, mask, clip=clip)
    count = mask.bool().sum()
    if int(count) == 0:
        raise ValueError("mask selects no tokens: no value loss to take")
    return per_token.sum() / count, {"clip_fraction": clipped.sum().float() / count}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens (1: perfect, 0: no better than a
    constant, < 0: worse); nan when the returns do not vary."""
    keep = mask.bool()
    r, v = returns.double()[keep], values.double()[keep]
    if r.numel() < 2:
        return float("nan")
    var = r.var()
    return float("nan") if float(var) == 0.0 else float(1.0 - (r - v).var() / var)
