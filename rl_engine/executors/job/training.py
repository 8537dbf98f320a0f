"""The step's train stage: every policy rank trains on its shard of the batch; PPO's critic beside it.

`train_on_batch`: (PPO: the critic ranks' values of the batch -> GAE advantages and
returns, `ppo_step.gae_batch` -> the critic's update, started) -> every trainer rank's
`train_step` on its rows of each of the step's mini-batches (during PPO's
`critic.warmup_steps`: parity forward only, no update), gathered with the critic's ->
rank 0's metrics (they are all-reduced) and, for PPO, the critic/* figures
(`ppo_step.critic_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_engine.config import RunConfig
from rl_engine.executors.job.faults import ActorInfo, gather
from rl_engine.executors.job.ppo_step import critic_metrics, gae_batch
from rl_engine.executors.job.step_metrics import StepClock


@dataclass
class Trained:
    """What the train stage leaves for the rest of the step."""

    policy: dict
    """Trainer rank 0's metrics (all-reduced over the ranks), `weight_version` among them."""
    critic: dict = field(default_factory=dict)
    """critic/* (PPO); empty without a critic."""


def train_on_batch(
    config: RunConfig,
    trainers: list[ActorInfo],
    critics: list[ActorInfo],
    batch,
    completions: list,
    step: int,
    clock: StepClock,
) -> Trained:
    """The policy's update on `batch` (and PPO's critic's, on GAE advantages from its values of
    it), timed as the clock's `critic_values`, `train` and `train_compute` (the slowest rank's)."""
    mini_batches, update, critic_calls, figures = config.mini_batches_per_step, True, [], None
    if critics:
        with clock.phase("critic_values"):
            values = _critic_values(critics, batch)  # (B, T-1): V before this step's update
        batch, returns = gae_batch(config, batch, completions, values)
        critic_calls = _critic_updates(critics, batch, returns, values, mini_batches)
        update = step >= config.critic.warmup_steps
        figures = (values, returns, batch.response_mask)
    with clock.phase("train"):  # the policy and (PPO) the critic at once
        calls = _policy_updates(trainers, batch, mini_batches, update)
        results = gather(calls + critic_calls)
    policy, critic_results = results[: len(trainers)], results[len(trainers) :]
    clock.add("train_compute", max(m.pop("time/train_compute") for m in policy))
    if figures is None:
        return Trained(policy[0])
    return Trained(policy[0], critic_metrics(critic_results, *figures, warmup=not update))


def _policy_updates(trainers: list[ActorInfo], batch, mini_batches: int, update: bool) -> list:
    """Every rank's train_step on its shard of `batch` (its rows of each of the step's
    `mini_batches`; `update=False`: parity forward only, the critic warm-up) as (actor, ref)
    calls, rank 0 first; their metrics come back all-reduced."""
    world = len(trainers)
    return [
        (a, a.handle.train_step.remote(batch.shard(r, world, mini_batches), update))
        for r, a in enumerate(trainers)
    ]


def _critic_values(critics: list[ActorInfo], batch):
    """(B, T-1) fp32 values of the whole batch: each critic rank scores its contiguous shard."""
    import torch

    world = len(critics)
    calls = [(c, c.handle.values.remote(batch.shard(r, world))) for r, c in enumerate(critics)]
    return torch.cat(gather(calls))


def _critic_updates(critics: list[ActorInfo], batch, returns, old_values, mini_batches: int):
    """Remote critic updates (each rank its rows of each mini-batch, with their returns and
    values) as (actor, ref) calls; the caller gathers them with the policy's."""
    world, calls = len(critics), []
    for r, c in enumerate(critics):
        rows = batch.shard_rows(r, world, mini_batches)
        shard = batch.shard(r, world, mini_batches)
        calls.append((c, c.handle.train_step.remote(shard, returns[rows], old_values[rows])))
    return calls
