"""The step's batch stage: completions and rewards -> the TrainBatch every rank takes its shard of.

(Named for the step, beside `executors/worker/batch.py`, which defines TrainBatch itself.)
"""

from __future__ import annotations

from rl_engine.config import RunConfig
from rl_engine.rollout import Completion


def train_batch(config: RunConfig, completions: list[Completion], rewards: list[float], eos):
    """The step's TrainBatch, padded with EOS; its advantages are `algorithm.advantage`'s
    (rl_engine.algorithms.compute_advantages) over the prompts' groups. PPO: zeros here, GAE
    from the critic's values of this layout in the train stage (`ppo_step.gae_batch`)."""
    from rl_engine.executors.worker.batch import TrainBatch

    algo = config.algorithm
    return TrainBatch.from_completions(
        completions,
        rewards,
        samples_per_prompt=config.rollout.samples_per_prompt,
        pad_token_id=eos if isinstance(eos, int) else 0,
        normalize_std=algo.normalize_std,
        advantage=None if algo.name == "ppo" else algo.advantage,
        gamma=algo.gamma,
    )
