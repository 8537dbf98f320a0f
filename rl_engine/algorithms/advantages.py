"""Advantage estimators for policy-gradient RL on LLM completions.

GRPO samples `group_size` completions per prompt and uses each completion's
reward relative to its own group as the advantage, so no value model is needed.
Pure torch: no model, tokenizer or DeepSpeed knowledge.
"""

from __future__ import annotations

from torch import Tensor


def group_normalized_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: `(r - mean(group)) / (std(group) + eps)`, fp32, shape `[N]`.

    Groups are consecutive blocks of `group_size` rewards (all completions of one
    prompt next to each other). The std is the unbiased (Bessel-corrected) one, as
    in the GRPO paper's reference code; a group whose rewards are all equal carries
    no learning signal and gets advantage 0. With `normalize_std=False` only the
    group mean is subtracted (Dr. GRPO).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"number of rewards N={n} is not a multiple of group_size={group_size}")
    groups = rewards.detach().float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        # A group of one has no spread; correction=0 gives std 0 (and advantage 0), not NaN.
        std = groups.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)
        centered = centered / (std + eps)
    return centered.reshape(n)
