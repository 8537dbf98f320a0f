"""Rollout correction modes: weights, dropped tokens, and the denominator rule, on hand-made ratios."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.algorithms import CORRECTION_MODES, policy_loss, rollout_correction

C = 2.0
# Token log-ratios trainer - rollout. Row 0: ratios [1, 3, 0.25, 1.5] (sequence ratio 1.125);
# row 1: ratios [1.8, 1.8, pad] (sequence ratio 3.24, outside [1/2, 2]).
LOG_RATIOS = [[0.0, math.log(3.0), math.log(0.25), math.log(1.5)], [math.log(1.8)] * 2 + [0.0, 0.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)


def _batch():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.7, float("inf"), float("nan")]])
    trainer = rollout + torch.tensor(LOG_RATIOS)
    return trainer, rollout


def _ratios(values):
    return torch.tensor(values, dtype=torch.float32)


EXPECTED = {  # mode -> (weights, kept mask)
    "none": ([[1, 1, 1, 1], [1, 1, 0, 0]], MASK.tolist()),
    "token_truncate": ([[1, 2, 0.25, 1.5], [1.8, 1.8, 0, 0]], MASK.tolist()),
    "token_mask": ([[1, 0, 0, 1.5], [1.8, 1.8, 0, 0]], [[1, 0, 0, 1], [1, 1, 0, 0]]),
    "sequence_truncate": ([[1.125] * 4, [2, 2, 0, 0]], MASK.tolist()),
    "sequence_mask": ([[1.125] * 4, [0, 0, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]]),
}


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_each_mode_weights_and_drops_as_specified(mode):
    trainer, rollout = _batch()
    c = rollout_correction(trainer, rollout, MASK, mode=mode, threshold=C)
    weights, kept = EXPECTED[mode]
    torch.testing.assert_close(c.weights, _ratios(weights), rtol=1e-5, atol=0)
    assert c.mask.tolist() == [[bool(v) for v in row] for row in kept]
    assert torch.equal(c.dropped, MASK & ~c.mask)
    assert not c.weights.requires_grad and bool(torch.isfinite(c.weights).all())
    if mode == "token_truncate":
        assert c.truncated.tolist() == [[False, True, False, False], [False] * 4]
    if mode == "sequence_truncate":
        assert c.truncated.tolist() == [[False] * 4, [True, True, False, False]]


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_with_bitwise_parity_every_mode_is_the_identity(mode):
    _, rollout = _batch()
    c = rollout_correction(rollout.clone(), rollout, MASK, mode=mode, threshold=1.0001)
    assert torch.equal(c.mask, MASK) and torch.equal(c.weights, MASK.float())
    assert not c.truncated.any() and not c.dropped.any()


def test_a_dropped_token_leaves_the_denominator_not_only_the_numerator():
    """token-mean: sum over kept tokens / number of kept tokens (4 of 6 here), not / 6."""
    trainer, rollout = _batch()
    c = rollout_correction(trainer, rollout, MASK, mode="token_mask", threshold=C)
    logp = trainer.clone().requires_grad_(True)
    old = trainer.detach()  # decoupled: the PPO ratio is against the trainer's own old logprobs
    advantages = torch.tensor([1.0, -2.0])
    loss, _ = policy_loss(logp, old, advantages, c.mask, is_weights=c.weights)
    per_token = -(c.weights * advantages[:, None])  # ratio to old is 1: no clipping
    kept = c.mask
    assert int(kept.sum()) == 4
    expected = per_token[kept].sum() / kept.sum()
    torch.testing.assert_close(loss, expected)
    zeroed_only = per_token[kept].sum() / MASK.sum()  # negative control: weight 0, still counted
    assert not torch.isclose(loss, zeroed_only)


def test_a_dropped_sequence_does_not_dilute_the_sequence_mean():
    trainer, rollout = _batch()
    c = rollout_correction(trainer, rollout, MASK, mode="sequence_mask", threshold=C)
    advantages = torch.tensor([1.0, -2.0])
    loss, _ = policy_loss(
        trainer,
        trainer,
        advantages,
        c.mask,
        is_weights=c.weights,
        aggregation="seq-mean-token-mean",
    )
    torch.testing.assert_close(loss, torch.tensor(-1.125))  # row 0 alone: mean of -1.125 * 1


def test_bad_arguments_name_the_problem():
    trainer, rollout = _batch()
    with pytest.raises(ValueError, match=r"unknown rollout correction 'tis'; valid: \['none'"):
        rollout_correction(trainer, rollout, MASK, mode="tis")
    with pytest.raises(ValueError, match="threshold must be > 1"):
        rollout_correction(trainer, rollout, MASK, mode="token_mask", threshold=1.0)
    with pytest.raises(ValueError, match=r"mask has shape \[2, 3\]"):
        rollout_correction(trainer, rollout, MASK[:, :3], mode="token_mask")
