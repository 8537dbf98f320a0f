"""RL algorithms as pure torch functions: advantage estimators, PPO/GRPO/GSPO losses, KL,
reward shaping, rollout correction, the critic's value loss, and the router terms of mixture-of-experts policies."""

from rl_engine.algorithms.advantages import group_normalized_advantages
from rl_engine.algorithms.correction import CORRECTION_MODES, RolloutCorrection, rollout_correction
from rl_engine.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rl_engine.algorithms.losses import (
    AGGREGATIONS,
    RATIO_LEVELS,
    PolicyTerms,
    aggregate,
    aggregation_units,
    kl_k3,
    masked_mean,
    policy_loss,
    policy_loss_terms,
)
from rl_engine.algorithms.router import expert_counts, load_balancing_loss, load_statistics
from rl_engine.algorithms.shaping import overlong_penalty
from rl_engine.algorithms.value_loss import (
    clipped_value_loss,
    explained_variance,
    value_loss_terms,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CORRECTION_MODES",
    "RATIO_LEVELS",
    "RolloutCorrection",
    "aggregate",
    "aggregation_units",
    "clipped_value_loss",
    "compute_advantages",
    "gae_advantages",
    "expert_counts",
    "explained_variance",
    "group_normalized_advantages",
    "grpo_advantages",
    "kl_k3",
    "load_balancing_loss",
    "load_statistics",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_terms",
    "PolicyTerms",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_correction",
    "value_loss_terms",
]
