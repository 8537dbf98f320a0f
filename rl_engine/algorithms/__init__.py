"""RL algorithms as pure torch functions: GRPO advantages, PPO/GRPO losses, KL, TIS."""

from rl_engine.algorithms.advantages import group_normalized_advantages
from rl_engine.algorithms.losses import (
    AGGREGATIONS,
    aggregate,
    aggregation_units,
    kl_k3,
    masked_mean,
    policy_loss,
    truncated_importance_weights,
)

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "aggregation_units",
    "group_normalized_advantages",
    "kl_k3",
    "masked_mean",
    "policy_loss",
    "truncated_importance_weights",
]
