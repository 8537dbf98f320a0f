"""RL algorithms as pure torch functions: GRPO advantages, PPO/GRPO losses, KL, rollout correction,
and the router terms of mixture-of-experts policies."""

from rl_engine.algorithms.advantages import group_normalized_advantages
from rl_engine.algorithms.correction import CORRECTION_MODES, RolloutCorrection, rollout_correction
from rl_engine.algorithms.losses import (
    AGGREGATIONS,
    aggregate,
    aggregation_units,
    kl_k3,
    masked_mean,
    policy_loss,
)
from rl_engine.algorithms.router import expert_counts, load_balancing_loss, load_statistics

__all__ = [
    "AGGREGATIONS",
    "CORRECTION_MODES",
    "RolloutCorrection",
    "aggregate",
    "aggregation_units",
    "expert_counts",
    "group_normalized_advantages",
    "kl_k3",
    "load_balancing_loss",
    "load_statistics",
    "masked_mean",
    "policy_loss",
    "rollout_correction",
]
