"""The step's batch stage: hand-made completions and rewards become a TrainBatch right-padded
with the EOS id (0 when the model's EOS is not one int), GRPO advantages over each prompt's
group (a group's better sample gets the positive one, an all-equal group zeros), and zero
advantages for PPO, whose GAE comes later from the critic."""

from __future__ import annotations

import torch

from rl_engine.config import RunConfig
from rl_engine.executors.job.step_batch import train_batch
from rl_engine.rollout import Completion

EOS = 2


def completion(prompt_index: int, sample_index: int, tokens: list[int]) -> Completion:
    return Completion(
        prompt_ids=[5, 6],
        token_ids=tokens,
        logprobs=torch.full((len(tokens),), -0.5),
        finish_reason="stop",
        weight_version=1,
        prompt_index=prompt_index,
        sample_index=sample_index,
    )


def two_groups() -> list[Completion]:
    return [
        completion(0, 0, [7, EOS]),
        completion(0, 1, [8, 9, EOS]),
        completion(1, 0, [7]),
        completion(1, 1, [9]),
    ]


def config(algorithm: str = "grpo") -> RunConfig:
    data = {"rollout": {"samples_per_prompt": 2}, "algorithm": {"name": algorithm}}
    if algorithm == "ppo":
        data["algorithm"]["advantage"] = "gae"
    return RunConfig.from_dict(data)


def test_rows_are_padded_with_eos_and_scored_on_completion_tokens():
    batch = train_batch(config(), two_groups(), [1.0, 0.0, 0.5, 0.5], EOS)
    assert batch.input_ids.tolist() == [
        [5, 6, 7, EOS, EOS],
        [5, 6, 8, 9, EOS],
        [5, 6, 7, EOS, EOS],
        [5, 6, 9, EOS, EOS],
    ]
    assert batch.attention_mask.tolist()[0] == [1, 1, 1, 1, 0]
    # response_mask[t] marks the prediction of token t+1: the completion's tokens only
    assert batch.response_mask.tolist()[1] == [False, True, True, True]
    assert batch.num_tokens == 2 + 3 + 1 + 1
    assert torch.equal(batch.rewards, torch.tensor([1.0, 0.0, 0.5, 0.5]))
    assert batch.weight_version == 1


def test_grpo_advantages_rank_within_each_prompts_group():
    adv = train_batch(config(), two_groups(), [1.0, 0.0, 0.5, 0.5], EOS).advantages
    assert adv.shape == (4,)
    assert adv[0] > 0 and torch.equal(adv[1], -adv[0])
    assert torch.equal(adv[2:], torch.zeros(2))  # a group whose rewards are equal teaches nothing


def test_a_non_int_eos_pads_with_zero():
    batch = train_batch(config(), two_groups(), [1.0, 0.0, 0.5, 0.5], [EOS, 3])
    assert batch.input_ids[0].tolist() == [5, 6, 7, EOS, 0]


def test_ppo_advantages_are_zeros_until_the_critic_sets_them():
    batch = train_batch(config("ppo"), two_groups(), [1.0, 0.0, 0.5, 0.5], EOS)
    assert torch.equal(batch.advantages, torch.zeros(4))
