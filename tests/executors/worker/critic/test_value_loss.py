"""The critic's micro-batch loss (executors/worker/critic/value_loss.py) on hand-sized values:
PPO's clipped value loss 0.5 max((v - R)^2, (clip(v) - R)^2) as the micro-batch's share of the
mini-batch's token mean (the sum over U, the mini-batch's tokens on every rank).

Plain path: that share times `scale` (undoing DeepSpeed's averaging), one record of the loss,
the clipped tokens and the tokens. Layout-invariant path (`scale` None): each token's term
weighted 1 / U, one record per sequence; a token's gradient is its own term's over U, whatever
else the micro-batch holds, and nothing reaches a token off the mask."""

from __future__ import annotations

import math

import torch

from rl_engine.exact.records import SequenceRecords
from rl_engine.executors.worker.critic.value_loss import ValueLossSums, value_micro_loss

UNITS = 3.0
CLIP = 0.2


def _inputs():
    """Row 0: an unclipped token (v 1, old 0.5, R 0: 0.5 (1 - 0)^2 = 0.5) and a clipped one
    (v 0, old 1, R 0: clip(v) = 0.8, 0.5 * 0.8^2 = 0.32), then padding; row 1: v = R (0)."""
    values = torch.tensor([[1.0, 0.0, 7.0], [2.0, 5.0, 5.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    old = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    return values, returns, old, mask


def test_the_plain_loss_is_the_micro_batchs_share_of_the_token_mean_times_scale():
    values, returns, old, mask = _inputs()
    loss, record = value_micro_loss(values, returns, old, mask, clip=CLIP, units=UNITS, scale=2)
    assert isinstance(record, ValueLossSums)
    assert math.isclose(float(loss.detach()), 2 * (0.5 + 0.32) / 3, rel_tol=1e-6)
    assert math.isclose(record.loss, (0.5 + 0.32) / 3, rel_tol=1e-6)
    assert (record.clipped, record.tokens) == (1.0, 3.0)


def test_the_layout_invariant_loss_keeps_one_record_per_sequence():
    values, returns, old, mask = _inputs()
    loss, records = value_micro_loss(values, returns, old, mask, clip=CLIP, units=UNITS, scale=None)
    assert isinstance(records, SequenceRecords) and len(records.records) == 2
    first, second = records.records
    assert math.isclose(first.loss, (0.5 + 0.32) / 3, rel_tol=1e-6)
    assert (first.clipped, first.tokens) == (1.0, 2.0)
    assert (second.loss, second.clipped, second.tokens) == (0.0, 0.0, 1.0)
    assert math.isclose(float(loss.detach()), (0.5 + 0.32) / 3, rel_tol=1e-6)


def test_a_tokens_gradient_is_its_own_term_over_the_units():
    values, returns, old, mask = _inputs()
    loss, _ = value_micro_loss(values, returns, old, mask, clip=CLIP, units=UNITS, scale=None)
    loss.backward()
    # d/dv 0.5 (v - R)^2 = v - R = 1 for the unclipped token; the clipped one's clamp is
    # saturated (no gradient); padding and v = R get none
    want = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) * torch.tensor(1 / UNITS)
    assert torch.equal(values.grad, want)
    alone = _inputs()[0][:1].detach().requires_grad_(True)
    loss, _ = value_micro_loss(
        alone, returns[:1], old[:1], mask[:1], clip=CLIP, units=UNITS, scale=None
    )
    loss.backward()
    assert torch.equal(alone.grad, want[:1])
