"""Tests for GRPO group-normalised advantages."""

import math

import pytest
import torch

from rl_engine.algorithms import group_normalized_advantages


def test_hand_computed_group_of_three():
    # Group [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1] (up to eps).
    # Group [0, 0, 6]: mean 2, unbiased std sqrt((4 + 4 + 16) / 2) = sqrt(12).
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    adv = group_normalized_advantages(rewards, 3, eps=0.0)
    s = math.sqrt(12.0)
    expected = torch.tensor([-1.0, 0.0, 1.0, -2.0 / s, -2.0 / s, 4.0 / s])
    torch.testing.assert_close(adv, expected)


def test_each_group_has_mean_zero_and_std_one():
    rewards = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 3 + 5
    adv = group_normalized_advantages(rewards, 8).view(5, 8)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(dim=1), torch.ones(5), atol=1e-5, rtol=0)


def test_groups_are_consecutive_blocks():
    # Same values in each group but shifted: normalised advantages must coincide.
    rewards = torch.tensor([0.0, 1.0, 10.0, 11.0])
    adv = group_normalized_advantages(rewards, 2)
    torch.testing.assert_close(adv[:2], adv[2:])


def test_without_std_only_mean_is_subtracted():
    rewards = torch.tensor([1.0, 3.0, 10.0, 20.0])
    adv = group_normalized_advantages(rewards, 2, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -5.0, 5.0]))


def test_constant_group_and_group_of_one_give_zero_not_nan():
    assert torch.equal(group_normalized_advantages(torch.full((4,), 0.5), 4), torch.zeros(4))
    assert torch.equal(group_normalized_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))


def test_output_is_fp32_and_detached():
    rewards = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    adv = group_normalized_advantages(rewards, 2)
    assert adv.dtype == torch.float32 and not adv.requires_grad


def test_indivisible_length_names_both_numbers():
    with pytest.raises(ValueError, match=r"N=7.*samples_per_prompt=3"):
        group_normalized_advantages(torch.zeros(7), 3)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_bad_samples_per_prompt(bad):
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_normalized_advantages(torch.zeros(4), bad)


def test_rewards_must_be_1d():
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_normalized_advantages(torch.zeros(2, 2), 2)
