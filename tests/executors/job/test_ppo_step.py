"""PPO's share of a step on hand-made completions: with gamma = lam = 1 and zero values, GAE
gives each completion token its sequence's reward, the returns are that reward on the
completion tokens (0 elsewhere), the policy's advantages are those whitened over the batch's
completion tokens; critic/* reports the update's figures and the rollout-time values' means."""

from __future__ import annotations

import torch

from rl_engine.algorithms.estimators import WHITEN_EPS
from rl_engine.config import RunConfig
from rl_engine.executors.job.ppo_step import critic_metrics, gae_batch
from rl_engine.executors.job.step_batch import train_batch
from rl_engine.rollout import Completion

REWARDS = [1.0, 0.0, 0.5, 0.5]


def completion(prompt_index: int, tokens: list[int]) -> Completion:
    return Completion([5, 6], tokens, torch.zeros(len(tokens)), "stop", 1, prompt_index, 0)


def ppo_batch():
    config = RunConfig.from_dict(
        {"rollout": {"samples_per_prompt": 2}, "algorithm": {"name": "ppo", "advantage": "gae"}}
    )
    completions = [
        completion(0, [7, 2]),
        completion(0, [8, 9, 2]),
        completion(1, [7]),
        completion(1, [9]),
    ]
    return config, train_batch(config, completions, REWARDS, 2), completions


def test_gae_with_zero_values_spreads_each_reward_over_its_completion_tokens():
    config, batch, completions = ppo_batch()
    mask = batch.response_mask
    values = torch.zeros(mask.shape)
    whitened, returns = gae_batch(config, batch, completions, values)
    expected = torch.where(mask, torch.tensor(REWARDS)[:, None], 0.0)
    assert torch.equal(returns, expected)
    scored = expected[mask]
    mean, std = scored.mean(), scored.var(correction=1).add(WHITEN_EPS).rsqrt()
    assert torch.allclose(whitened.advantages[mask], (scored - mean) * std, rtol=0, atol=1e-6)
    assert torch.equal(whitened.advantages[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(whitened.input_ids, batch.input_ids)  # only the advantages change


def test_returns_add_the_values_back():
    config, batch, completions = ppo_batch()
    mask = batch.response_mask
    values = torch.where(mask, 0.25, 0.0)
    _, returns = gae_batch(config, batch, completions, values)
    _, zero_value_returns = gae_batch(config, batch, completions, torch.zeros(mask.shape))
    # V(t) = 0.25 everywhere: delta_t = r_t + V(t+1) - V(t) telescopes to R - V(t) + 0 at the end
    assert torch.allclose(returns, zero_value_returns, rtol=0, atol=1e-6)


def test_critic_metrics_report_the_update_and_the_rollout_values():
    mask = torch.tensor([[True, True, False]])
    values = torch.tensor([[1.0, 3.0, 100.0]])
    returns = torch.tensor([[2.0, 4.0, 0.0]])
    update = {"critic/value_loss": 0.5, "critic/clip_fraction": 0.25, "critic/skipped_update": 0}
    metrics = critic_metrics([update, {}], values, returns, mask, warmup=True)
    assert metrics["critic/values_mean"] == 2.0  # the unmasked 100 is left out
    assert metrics["critic/returns_mean"] == 3.0
    assert metrics["critic/explained_variance"] == 1.0  # R - V is constant
    assert metrics["critic/value_loss"] == 0.5 and metrics["critic/clip_fraction"] == 0.25
    assert metrics["critic/warmup"] == 1 and metrics["critic/skipped_update"] == 0
