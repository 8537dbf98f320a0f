"""Advantage estimators against hand-computed examples (never against their own code).

Each case writes the numbers out: groups of unequal reward and size, interleaved group
indices, a group whose rewards are all equal, masks with prompt positions and padding.
"""

import math

import pytest
import torch

from rl_engine.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages

# Three prompts, interleaved, of sizes 3, 2 and 2: group 7 -> [1, 2, 6], group 3 -> [4, 4]
# (all equal), group 5 -> [0, 1].
REWARDS = torch.tensor([1.0, 4.0, 2.0, 0.0, 6.0, 4.0, 1.0])
GROUPS = torch.tensor([7, 3, 7, 5, 7, 3, 5])
# Completion tokens: row 0 has a prompt position first, row 3 two padding positions last.
MASK = torch.tensor(
    [
        [0, 1, 1, 1],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [0, 0, 1, 1],
        [1, 1, 1, 0],
        [1, 1, 0, 0],
    ],
    dtype=torch.bool,
)


def _broadcast(per_seq):
    return torch.where(MASK, torch.tensor(per_seq)[:, None], 0.0)


def test_grpo_hand_computed():
    # group 7: mean 3, unbiased std sqrt((4 + 1 + 9) / 2) = sqrt(7); group 3: all equal -> 0;
    # group 5: mean 0.5, std sqrt(0.5).
    s7, s5 = math.sqrt(7.0), math.sqrt(0.5)
    per_seq = [-2 / s7, 0.0, -1 / s7, -0.5 / s5, 3 / s7, 0.0, 0.5 / s5]
    adv = compute_advantages("grpo", REWARDS, GROUPS, mask=MASK, eps=0.0)
    torch.testing.assert_close(adv, _broadcast(per_seq))
    dr = compute_advantages("grpo", REWARDS, GROUPS, mask=MASK, normalize_std=False)
    torch.testing.assert_close(dr, _broadcast([-2.0, 0.0, -1.0, -0.5, 3.0, 0.0, 0.5]))


def test_rloo_hand_computed():
    # r_i - mean(others): group 7 -> 1 - 4, 2 - 3.5, 6 - 1.5; group 3 -> 0, 0; group 5 -> -1, 1.
    per_seq = [-3.0, 0.0, -1.5, -1.0, 4.5, 0.0, 1.0]
    adv = compute_advantages("rloo", REWARDS, GROUPS, mask=MASK)
    torch.testing.assert_close(adv, _broadcast(per_seq))
    assert torch.equal(
        compute_advantages("rloo", REWARDS, GROUPS), torch.tensor(per_seq)
    )  # no mask: one per sequence


def test_group_of_one_and_equal_group_give_zero():
    rewards, groups = torch.tensor([3.0, 2.0, 2.0]), torch.tensor([0, 1, 1])
    for name in ("grpo", "rloo"):
        assert torch.equal(compute_advantages(name, rewards, groups), torch.zeros(3))


def _whiten(values_per_token):
    flat = torch.tensor(values_per_token, dtype=torch.float64)
    mean, var = flat.mean(), flat.var(correction=1)
    return [(v - mean.item()) / math.sqrt(var.item() + 1e-8) for v in values_per_token]


def test_reinforce_pp_hand_computed_gamma_1_and_discounted():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rewards, groups = torch.tensor([1.0, -1.0]), torch.tensor([0, 0])
    # gamma = 1: every completion token carries its sequence's reward: tokens 1, 1, -1, -1.
    w = _whiten([1.0, 1.0, -1.0, -1.0])
    expected = torch.tensor([[0.0, w[0], w[1]], [w[2], w[3], 0.0]])
    adv = compute_advantages("reinforce_pp", rewards, groups, mask=mask)
    torch.testing.assert_close(adv, expected)
    # gamma = 0.5: returns 0.5, 1 (row 0) and -0.5, -1 (row 1), then whitened.
    w = _whiten([0.5, 1.0, -0.5, -1.0])
    expected = torch.tensor([[0.0, w[0], w[1]], [w[2], w[3], 0.0]])
    adv = compute_advantages("reinforce_pp", rewards, groups, mask=mask, gamma=0.5)
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_baseline_hand_computed():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    rewards, groups = torch.tensor([1.0, 0.0, 5.0]), torch.tensor([2, 2, 9])
    # baselines: group 2 mean 0.5 -> 0.5, -0.5; group 9 alone -> 0. Tokens: .5 .5 -.5 -.5 -.5 0
    w = _whiten([0.5, 0.5, -0.5, -0.5, -0.5, 0.0])
    expected = torch.tensor([[w[0], w[1], 0.0], [w[2], w[3], w[4]], [w[5], 0.0, 0.0]])
    adv = compute_advantages("reinforce_pp_baseline", rewards, groups, mask=mask)
    torch.testing.assert_close(adv, expected)


def test_gae_hand_computed():
    # One row, completion at columns 1..3, reward 1 on column 3, V = [-, 0.5, 0.2, 0.4, -].
    mask = torch.tensor([[0, 1, 1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[9.0, 0.5, 0.2, 0.4, 9.0]])  # 9: off the mask, never read
    gamma, lam = 0.9, 0.8
    d3 = 1.0 + gamma * 0.0 - 0.4  # terminal: V after the last token is 0
    d2 = 0.0 + gamma * 0.4 - 0.2
    d1 = 0.0 + gamma * 0.2 - 0.5
    a3 = d3
    a2 = d2 + gamma * lam * a3
    a1 = d1 + gamma * lam * a2
    adv = compute_advantages(
        "gae",
        torch.tensor([1.0]),
        torch.tensor([0]),
        mask=mask,
        values=values,
        gamma=gamma,
        lam=lam,
    )
    torch.testing.assert_close(adv, torch.tensor([[0.0, a1, a2, a3, 0.0]]))
    # gamma = lam = 1: A_t = r - V_t (a Monte-Carlo return minus the value)
    adv = compute_advantages(
        "gae", torch.tensor([1.0]), torch.tensor([0]), mask=mask, values=values
    )
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.8, 0.6, 0.0]]))


def test_gae_rows_are_independent_and_empty_rows_are_zero():
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.25, 0.5], [1.0, 1.0]])
    adv = compute_advantages(
        "gae", torch.tensor([2.0, 7.0]), torch.tensor([0, 1]), mask=mask, values=values
    )
    torch.testing.assert_close(adv, torch.tensor([[1.75, 1.5], [0.0, 0.0]]))


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS)
def test_zero_off_the_mask_and_fp32(name):
    values = torch.randn(MASK.shape) if name == "gae" else None
    adv = compute_advantages(name, REWARDS, GROUPS, mask=MASK, values=values)
    assert adv.dtype == torch.float32 and adv.shape == MASK.shape
    assert torch.equal(adv[~MASK], torch.zeros(int((~MASK).sum())))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", REWARDS, GROUPS)
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", REWARDS, GROUPS, mask=MASK)
    with pytest.raises(ValueError, match="values are only used by 'gae'"):
        compute_advantages("grpo", REWARDS, GROUPS, values=torch.zeros(MASK.shape))
    with pytest.raises(ValueError, match="needs mask"):
        compute_advantages("reinforce_pp", REWARDS, GROUPS)
    with pytest.raises(ValueError, match=r"group_index must be \(B,\)"):
        compute_advantages("grpo", REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="group_index must hold integers"):
        compute_advantages("grpo", REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_advantages("gae", REWARDS, GROUPS, mask=MASK, values=torch.zeros(7, 4), gamma=2)


def _grouped_arithmetic(rewards, size, normalize_std=True, eps=1e-6):
    """GRPO in the (G, n) layout, as TrainBatch computed it before the estimators."""
    groups = rewards.view(-1, size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        std = groups.std(dim=1, keepdim=True, correction=1 if size > 1 else 0)
        centered = centered / (std + eps)
    return centered.reshape(-1)


def test_grpo_keeps_the_grouped_arithmetic_bit_for_bit():
    """compute_advantages('grpo') on groups of one size, consecutive or interleaved, has the
    bits of the (G, n) arithmetic TrainBatch used before, so no run's numbers change; only a
    group whose rewards are all equal is exactly 0 where that arithmetic left rounding noise."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        size, count = (int(v) for v in torch.randint(1, 17, (2,), generator=gen))
        rewards = torch.rand(count * size, generator=gen)
        if trial % 2:
            rewards = rewards.round(decimals=1)
        groups = torch.arange(count * size) // size
        perm = torch.randperm(count * size, generator=gen)
        equal = (rewards.view(count, size) == rewards.view(count, size)[:, :1]).all(1)
        equal = equal.repeat_interleave(size)
        for normalize_std in (True, False):
            expected = torch.where(equal, 0.0, _grouped_arithmetic(rewards, size, normalize_std))
            got = compute_advantages("grpo", rewards, groups, normalize_std=normalize_std)
            assert torch.equal(got, expected)
            # interleaved rows: TrainBatch's order, groups by first row, members ascending
            r, g = rewards[perm], groups[perm]
            order = torch.cat([(g == k).nonzero()[:, 0] for k in dict.fromkeys(g.tolist())])
            want = torch.empty_like(r)
            equal_row = (r[order].view(count, size) == r[order].view(count, size)[:, :1]).all(1)
            want[order] = torch.where(
                equal_row.repeat_interleave(size),
                0.0,
                _grouped_arithmetic(r[order], size, normalize_std),
            )
            got = compute_advantages("grpo", r, g, normalize_std=normalize_std)
            assert torch.equal(got, want)


def test_grpo_all_equal_group_is_exactly_zero_where_the_plain_arithmetic_is_not():
    # 7 x 2/3: the rounded mean is not 2/3, and (r - mean) / (std + eps) makes that noise 3.6e-3
    rewards = torch.cat([torch.full((7,), 2.0 / 3.0), torch.arange(7.0)])
    groups = torch.arange(14) // 7
    assert _grouped_arithmetic(rewards, 7)[:7].abs().max() > 1e-3  # the negative control
    adv = compute_advantages("grpo", rewards, groups)
    assert torch.equal(adv[:7], torch.zeros(7))
    assert torch.equal(adv[7:], _grouped_arithmetic(rewards, 7)[7:])
    from rl_engine.algorithms import group_normalized_advantages

    assert torch.equal(group_normalized_advantages(rewards, 7), adv)
