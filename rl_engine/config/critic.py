"""The `critic:` section: PPO's value model (executors/worker/critic.py), its own DeepSpeed ranks.

How the critic's ranks split a step is a check across sections (cross_checks.py); what the
critic's worker reads as its trainer section is `RunConfig.critic_view` (run.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.config.trainer import check_zero_stage
from rl_engine.base.fields import check_int, check_number, check_text


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The value model of algorithm.name 'ppo' (ignored otherwise): its own DeepSpeed ranks."""

    model: str | None = None
    """`load_model` spec of the critic's backbone. null: the policy's model (same architecture,
    initialised from the policy's weights, tiny models from the run's seed). With lora.rank > 0
    the backbone, this one too, is frozen and carries the critic's own adapter (the lora:
    section's rank, alpha and targets, which must exist in it)."""
    lr: float = 1e-5
    """The critic's AdamW learning rate (weight decay and grad clip: the trainer's)."""
    num_ranks: int | None = None
    """Data-parallel DeepSpeed ranks of the critic (their own process group). null: trainer.num_ranks."""
    zero_stage: int | None = None
    """ZeRO stage of the critic (0-3). null: the trainer's (trainer.zero_stage, else its
    deepspeed config's)."""
    value_clip: float = 0.5
    """PPO value clipping (verl's cliprange_value, default 0.5): the new value may move at most
    this far from the rollout-time value before the clipped squared error takes over."""
    warmup_steps: int = 0
    """The first N RL steps train only the critic: the policy's optimizer does not step (its
    forward still runs, so parity is still checked)."""

    def __post_init__(self) -> None:
        if self.model is not None:
            check_text("critic.model", self.model)
        check_number("critic.lr", self.lr, low=0.0, low_open=True)
        if self.num_ranks is not None:
            check_int("critic.num_ranks", self.num_ranks, 1)
        check_zero_stage("critic.zero_stage", self.zero_stage)
        check_number("critic.value_clip", self.value_clip, low=0.0, low_open=True)
        check_int("critic.warmup_steps", self.warmup_steps, 0)
