"""The `algorithm:` section: the policy-gradient loss and its advantages (rl_engine.algorithms).

The estimator, aggregation, correction and ratio names are the ones rl_engine.algorithms
implements; this module only checks that a run names one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_engine.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, CORRECTION_MODES, RATIO_LEVELS
from rl_engine.base.fields import check_bool, check_choice, check_int, check_number, fail

ALGORITHMS = ("grpo", "ppo")
TURN_REWARDS = ("sum", "last")


def _check_overlong(value: Any) -> None:
    name = "algorithm.overlong_penalty"
    if not isinstance(value, dict) or set(value) != {"buffer", "factor"}:
        fail(name, "null or a mapping {buffer: int, factor: number}", value)
    check_int(f"{name}.buffer", value["buffer"], 1)
    check_number(f"{name}.factor", value["factor"], low=0.0)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Policy-gradient loss."""

    name: str = "grpo"
    """The loss family: 'grpo', the clipped surrogate without a critic, or 'ppo', the same
    surrogate with a value model (the `critic:` section) whose values give GAE advantages."""
    advantage: str | None = None
    """Advantage estimator (rl_engine.algorithms.compute_advantages): 'grpo', 'rloo',
    'reinforce_pp', 'reinforce_pp_baseline' or 'gae'. null: 'grpo' under name 'grpo', 'gae'
    under name 'ppo'. 'gae' needs the critic, which only name 'ppo' runs; 'ppo' trains its
    critic for 'gae' only, so it takes no other estimator."""
    gamma: float = 1.0
    """Discount of 'reinforce_pp' returns and of 'gae' (verl's default, 1.0)."""
    lam: float = 1.0
    """GAE's lambda (verl's default, 1.0: advantages are returns minus values)."""
    ratio_level: str = "token"
    """'token': the per-token PPO ratio; 'sequence': GSPO's length-normalised sequence ratio,
    clipped per sequence (pair it with loss_aggregation 'seq-mean-token-mean', as GSPO does)."""
    clip_eps: float = 0.2
    """Lower clip range of the ratio: clip(r, 1 - clip_eps, ...)."""
    clip_eps_high: float | None = None
    """Upper clip range (default: clip_eps; larger for DAPO clip-higher)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to a frozen reference policy (0 = no reference model)."""
    loss_aggregation: str = "token-mean"
    """'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum'."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (False = Dr. GRPO)."""
    rollout_correction: str = "none"
    """'none', 'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask' (docs/rollouts.md)."""
    correction_threshold: float = 2.0
    """C of the rollout correction: truncate caps the ratio at C; mask drops ratios outside [1/C, C]."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss of a mixture-of-experts policy (HF's formula, from the
    invariant router logits; 0 = none). A dense model with a coefficient > 0 is refused."""
    overlong_penalty: dict | None = None
    """DAPO's soft overlong punishment, added to each completion's reward: {buffer: C (int),
    factor: F} gives 0 up to rollout.max_new_tokens - C tokens, then down to -F linearly over
    the last C (rl_engine.algorithms.overlong_penalty). null: off."""
    turn_reward: str = "sum"
    """An episode's reward (rollout.env), the return its group compares: 'sum' of its turns'
    rewards, or the 'last' turn's."""

    def __post_init__(self) -> None:
        check_choice("algorithm.name", self.name, ALGORITHMS)
        if self.advantage is None:
            self.advantage = "gae" if self.name == "ppo" else "grpo"
        check_choice("algorithm.advantage", self.advantage, ADVANTAGE_ESTIMATORS)
        self._check_estimator_fits_the_loss()
        check_number("algorithm.gamma", self.gamma, low=0.0, high=1.0)
        check_number("algorithm.lam", self.lam, low=0.0, high=1.0)
        check_choice("algorithm.ratio_level", self.ratio_level, RATIO_LEVELS)
        check_number("algorithm.clip_eps", self.clip_eps, low=0.0, high=0.999999)
        if self.clip_eps_high is not None:
            check_number("algorithm.clip_eps_high", self.clip_eps_high, low=0.0)
        check_number("algorithm.kl_coef", self.kl_coef, low=0.0)
        check_choice("algorithm.loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        check_bool("algorithm.normalize_std", self.normalize_std)
        check_choice("algorithm.rollout_correction", self.rollout_correction, CORRECTION_MODES)
        check_number(
            "algorithm.correction_threshold", self.correction_threshold, low=1.0, low_open=True
        )
        check_number("algorithm.router_aux_loss_coef", self.router_aux_loss_coef, low=0.0)
        if self.overlong_penalty is not None:
            _check_overlong(self.overlong_penalty)
        check_choice("algorithm.turn_reward", self.turn_reward, TURN_REWARDS)

    def _check_estimator_fits_the_loss(self) -> None:
        """'gae' needs ppo's critic; ppo's critic is trained for 'gae' only."""
        if self.advantage == "gae" and self.name != "ppo":
            raise ValueError(
                "algorithm.advantage 'gae' needs a critic (per-token values), and "
                f"algorithm.name {self.name!r} has none; set algorithm.name: ppo (the critic: "
                "section) or pick grpo, rloo, reinforce_pp or reinforce_pp_baseline"
            )
        if self.name == "ppo" and self.advantage != "gae":
            raise ValueError(
                f"algorithm.advantage {self.advantage!r} does not use the critic that "
                "algorithm.name 'ppo' trains; use 'gae' (the default under ppo) or name 'grpo'"
            )
