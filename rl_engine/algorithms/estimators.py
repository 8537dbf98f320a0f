"""Advantage estimators: `compute_advantages(name, rewards, group_index, ...)` and one function each.

Every estimator is a pure torch function of one reward per sequence (`rewards`, `(B,)`),
the prompt each sequence answers (`group_index`, `(B,)` ints: groups in any order,
interleaved, of unequal sizes) and, where it needs them, the completion-token mask
(`mask`, `(B, T)` bool: in the worker the response mask, T - 1 wide) and per-token values.
The result is a per-token advantage shaped like `mask`, 0 off the mask, fp32; with
`mask=None` the sequence-level estimators return `(B,)`.

| name | advantage of sequence i in group g | paper |
|---|---|---|
| `grpo` | (r_i - mean_g) / (std_g + eps), std unbiased; `normalize_std=False`: r_i - mean_g | Shao et al. 2024 (DeepSeekMath); Dr. GRPO without the std |
| `rloo` | r_i - mean of the other rewards of g = n/(n-1) (r_i - mean_g), raw | Ahmadian et al. 2024 (Back to Basics / RLOO) |
| `reinforce_pp` | whiten(G_t) over the batch's completion tokens, G_t = sum_{s>=t} gamma^(s-t) r_s with r on the last token | Hu 2025 (REINFORCE++) |
| `reinforce_pp_baseline` | whiten(r_i - mean_g) over the batch's completion tokens | Hu 2025 (REINFORCE++ with baseline) |
| `gae` | A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, raw | Schulman et al. 2016 (GAE) |

Conventions (they decide the numbers, so they are part of the contract):
- A group of one has no peers: `grpo`, `rloo` and `reinforce_pp_baseline` give it 0 (no
  learning signal; its baseline is its own reward), like a group whose rewards are all equal.
- `whiten` (REINFORCE++ only) is (x - mean) / sqrt(var + 1e-8) over all completion tokens of
  the batch, with the unbiased variance: token-weighted, as REINFORCE++ normalises over the
  global batch. `grpo`, `rloo` and `gae` are never whitened here.
- `gae` and `reinforce_pp` put the sequence's reward on its last completion token (the last
  True of its mask row), and the value after that token is 0 (terminal). The recursion runs
  over the mask's tokens only: a gap in a mask row is skipped, never a boundary.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
WHITEN_EPS = 1e-8


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_index: Tensor,
    *,
    mask: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token advantages `(B, T)` shaped like `mask` (0 off it), fp32; see the module table.

    `values` (`(B, T)`, aligned with `mask`) is required by `gae` and refused by the others;
    `gamma` is used by `gae` and `reinforce_pp`, `lam` by `gae`; `normalize_std` and `eps`
    by `grpo`. With `mask=None`, `grpo`, `rloo` and `reinforce_pp_baseline`'s group step
    return one advantage per sequence, `(B,)` (the whitening estimators need a mask).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    rewards = _check_rewards(rewards)
    group_index = _check_groups(group_index, rewards.shape[0])
    if mask is not None:
        mask = _check_mask(mask, rewards.shape[0])
    if name != "gae" and values is not None:
        raise ValueError(f"values are only used by 'gae', not by {name!r}")
    for field, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{field} must be in [0, 1], got {value!r}")
    if name == "grpo":
        return _per_token(grpo_advantages(rewards, group_index, normalize_std, eps), mask)
    if name == "rloo":
        return _per_token(rloo_advantages(rewards, group_index), mask)
    if mask is None:
        raise ValueError(f"{name!r} needs mask: the (B, T) completion-token mask")
    if name == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, gamma=gamma)
    if name == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, group_index, mask)
    if values is None:
        raise ValueError("'gae' needs values: the critic's (B, T) value of each token")
    return gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)


# ----------------------------------------------------------------------------- the estimators


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """(B,) GRPO: (r_i - mean_g) / (std_g + eps) with the unbiased std; 0 for a group of one.

    Groups of one size are stacked as rows of one (G, n) matrix, in the order of their first
    member, and reduced along the rows, so a batch's advantages do not depend on how its
    groups are interleaved. A group whose rewards are all equal gets exactly 0.
    """
    out = torch.zeros_like(rewards)
    members = _groups_in_order(group_index)
    for size in sorted({m.numel() for m in members}):
        rows = torch.stack([m for m in members if m.numel() == size])  # (G, n) indices
        group = rewards[rows]
        centered = group - group.mean(dim=1, keepdim=True)
        # all rewards equal: exactly 0 (the rounded mean of n copies of x need not be x, and
        # centered / (std + eps) would then turn rounding noise into an advantage)
        centered = torch.where((group == group[:, :1]).all(dim=1, keepdim=True), 0.0, centered)
        if normalize_std:
            # a group of one has no spread: correction 0 gives std 0 and advantage 0, not NaN
            std = group.std(dim=1, keepdim=True, correction=1 if size > 1 else 0)
            # all rewards equal: centered is 0, and stays 0 even with eps = 0
            centered = torch.where(std + eps > 0, centered / (std + eps), 0.0)
        out[rows.reshape(-1)] = centered.reshape(-1)
    return out


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(B,) RLOO: r_i minus the mean of the other rewards of its group; 0 for a group of one."""
    out = torch.zeros_like(rewards)
    for members in _groups(group_index):
        n = members.numel()
        if n == 1:
            continue
        group = rewards[members]
        others_mean = (group.sum() - group) / (n - 1)
        out[members] = group - others_mean
    return out


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """(B, T) REINFORCE++: discounted return of the last-token reward, whitened over the batch."""
    token_rewards = _on_last_token(rewards, mask)  # (B, T)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(rewards)  # (B,)
    for t in reversed(range(mask.shape[1])):
        live = mask[:, t]
        running = torch.where(live, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(live, running, 0.0)
    return masked_whiten(returns, mask)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """(B, T) REINFORCE++ with baseline: r_i - mean_g on every token, whitened over the batch."""
    centered = torch.zeros_like(rewards)
    for members in _groups(group_index):
        group = rewards[members]
        centered[members] = group - group.mean()
    return masked_whiten(_per_token(centered, mask), mask)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> Tensor:
    """(B, T) GAE over each row's mask tokens; the reward on the last one, V after it 0. Raw.

    A_t = delta_t + gamma lam A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t (Schulman et al.).
    The returns a critic regresses to are A + values.
    """
    if not isinstance(values, Tensor) or values.shape != mask.shape:
        shape = None if not isinstance(values, Tensor) else list(values.shape)
        raise ValueError(f"values must be (B, T) = {list(mask.shape)} like mask, got {shape}")
    if not bool(torch.isfinite(torch.where(mask, values.float(), 0.0)).all()):
        raise ValueError("values must be finite at every masked (completion) token")
    values = torch.where(mask, values.float(), 0.0)
    token_rewards = _on_last_token(rewards, mask)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(rewards)  # (B,): V of the next completion token, 0 at the end
    running = torch.zeros_like(rewards)  # (B,): A of the next completion token
    for t in reversed(range(mask.shape[1])):
        live = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(live, step, running)
        next_value = torch.where(live, values[:, t], next_value)
        advantages[:, t] = torch.where(live, step, 0.0)
    return advantages


def masked_whiten(x: Tensor, mask: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased var), 0 off the mask."""
    keep = mask.bool()
    count = int(keep.sum())
    if count == 0:
        raise ValueError("mask selects no tokens: nothing to whiten")
    selected = x.float()[keep]
    mean = selected.mean()
    var = selected.var(correction=1) if count > 1 else selected.new_zeros(())
    return torch.where(keep, (x.float() - mean) * torch.rsqrt(var + eps), 0.0)


# ----------------------------------------------------------------------------- helpers


def _groups(group_index: Tensor) -> list[Tensor]:
    """Indices of each group's members, groups in order of their smallest index."""
    return [
        (group_index == g).nonzero(as_tuple=True)[0] for g in torch.unique(group_index).tolist()
    ]


def _groups_in_order(group_index: Tensor) -> list[Tensor]:
    """Indices of each group's members (ascending), groups in order of their first member."""
    groups = _groups(group_index)
    return sorted(groups, key=lambda m: int(m[0]))


def _per_token(per_sequence: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return per_sequence
    return torch.where(mask, per_sequence[:, None], 0.0)


def _on_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """(B, T): each row's reward at its last mask token, 0 elsewhere (and for an empty row)."""
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, columns, -1).max(dim=1).values  # (B,), -1 for an empty row
    return torch.where((columns[None, :] == last[:, None]) & mask, rewards[:, None], 0.0)


def _check_rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        shape = None if not isinstance(rewards, Tensor) else list(rewards.shape)
        raise ValueError(f"rewards must be a 1-D (B,) tensor, got shape {shape}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    return rewards.detach().float()


def _check_groups(group_index: Tensor, batch: int) -> Tensor:
    if not isinstance(group_index, Tensor) or group_index.shape != (batch,):
        shape = None if not isinstance(group_index, Tensor) else list(group_index.shape)
        raise ValueError(f"group_index must be (B,) = [{batch}] like rewards, got shape {shape}")
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must hold integers, got {group_index.dtype}")
    return group_index


def _check_mask(mask: Tensor, batch: int) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != batch:
        shape = None if not isinstance(mask, Tensor) else list(mask.shape)
        raise ValueError(f"mask must be (B, T) with B = {batch}, got shape {shape}")
    return mask.bool()
