"""PPO's share of a job step: GAE advantages from the critic's values, and the critic/* metrics.

Per step (algorithm.name 'ppo'): the critic ranks score the step's batch (V_old, the
values before this step's update) -> `gae_batch`: GAE advantages per token
(`compute_advantages("gae", ..., values=V_old, gamma, lam)`, the reward on each
sequence's last completion token, the value after it 0), whitened over the batch's
completion tokens for the policy loss (`masked_whiten`, as verl's GAE does), and the
critic's returns R = raw advantages + V_old -> the policy and the critic update at once
(the policy only after `critic.warmup_steps` steps) -> `critic_metrics`.
"""

from __future__ import annotations

import torch

from rl_engine.algorithms import compute_advantages, explained_variance, masked_whiten
from rl_engine.config import RunConfig


def gae_batch(config: RunConfig, batch, completions, values: torch.Tensor):
    """(batch with whitened GAE advantages (B, T-1), returns (B, T-1)) from `values` (B, T-1),
    the critic's values of `batch` (rows in the order of `completions`)."""
    algo, mask = config.algorithm, batch.response_mask
    groups = torch.tensor([c.prompt_index for c in completions], dtype=torch.long)
    advantages = compute_advantages(
        "gae", batch.rewards, groups, mask=mask, values=values, gamma=algo.gamma, lam=algo.lam
    )
    returns = torch.where(mask, advantages + values, 0.0)
    return batch.with_advantages(masked_whiten(advantages, mask)), returns


def critic_metrics(results: list[dict], values, returns, mask, *, warmup: bool) -> dict:
    """critic/*: the update's (value_loss, clip_fraction: from critic rank 0, all-reduced) and,
    over the step's completion tokens, explained_variance, values_mean and returns_mean of the
    rollout-time values; warmup 1 while the policy does not update yet."""
    update = results[0]
    return {
        "critic/value_loss": update["critic/value_loss"],
        "critic/clip_fraction": update["critic/clip_fraction"],
        "critic/explained_variance": explained_variance(values, returns, mask),
        "critic/values_mean": float(values[mask].double().mean()),
        "critic/returns_mean": float(returns[mask].double().mean()),
        "critic/skipped_update": update["critic/skipped_update"],
        "critic/warmup": int(warmup),
    }
