"""Advantage estimators for policy-gradient RL on LLM completions.

GRPO samples `samples_per_prompt` completions per prompt and uses each completion's
reward relative to its own group as the advantage, so no value model is needed.
Pure torch: no model, tokenizer or DeepSpeed knowledge.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl_engine.algorithms.estimators import grpo_advantages


def group_normalized_advantages(
    rewards: Tensor, samples_per_prompt: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: `(r - mean(group)) / (std(group) + eps)`, fp32, shape `[N]`.

    Groups are consecutive blocks of `samples_per_prompt` rewards (all completions of one
    prompt next to each other). The std is the unbiased (Bessel-corrected) one, as
    in the GRPO paper's reference code; a group whose rewards are all equal carries
    no learning signal and gets advantage 0. With `normalize_std=False` only the
    group mean is subtracted (Dr. GRPO).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if (
        isinstance(samples_per_prompt, bool)
        or not isinstance(samples_per_prompt, int)
        or samples_per_prompt < 1
    ):
        raise ValueError(f"samples_per_prompt must be a positive int, got {samples_per_prompt!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = rewards.shape[0]
    if n % samples_per_prompt != 0:
        raise ValueError(
            f"number of rewards N={n} is not a multiple of samples_per_prompt={samples_per_prompt}"
        )
    groups = torch.arange(n, device=rewards.device) // samples_per_prompt
    return grpo_advantages(rewards.detach().float(), groups, normalize_std, eps)
