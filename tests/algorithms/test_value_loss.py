"""PPO's clipped value loss and explained variance against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from rl_engine.algorithms import clipped_value_loss, explained_variance, value_loss_terms

# three completion tokens and one off the mask; clip 0.2 around V_old = 0.5
VALUES = [[1.0, 0.45, 0.0, 9.0]]
OLD = [[0.5, 0.5, 0.5, 0.5]]
RETURNS = [[2.0, 0.0, 1.0, -9.0]]
MASK = [[True, True, True, False]]


def _tensors():
    values = torch.tensor(VALUES, requires_grad=True)
    return values, torch.tensor(RETURNS), torch.tensor(OLD), torch.tensor(MASK)


def test_the_larger_of_the_clipped_and_unclipped_errors_counts():
    values, returns, old, mask = _tensors()
    # token 0: V_clip = 0.5 + 0.2 = 0.7; errors (1 - 2)^2 = 1, (0.7 - 2)^2 = 1.69 -> 1.69, clipped
    # token 1: inside the range, V_clip = V: both errors 0.45^2 = 0.2025, not clipped
    # token 2: V_clip = 0.3; errors (0 - 1)^2 = 1, (0.3 - 1)^2 = 0.49 -> 1, not clipped
    per_token, clipped = value_loss_terms(values, returns, old, mask, clip=0.2)
    expected = torch.tensor([[0.5 * 1.69, 0.5 * 0.2025, 0.5 * 1.0, 0.0]])
    assert torch.allclose(per_token, expected, atol=1e-6, rtol=0)
    assert clipped.tolist() == [[True, False, False, False]]
    loss, stats = clipped_value_loss(values, returns, old, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.2025 + 1.0) / 3, abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)
    loss.backward()
    # the clipped token gets no gradient (its clip is saturated); token 2: (V - R) / 3
    assert values.grad[0, 0].item() == 0.0 and values.grad[0, 3].item() == 0.0
    assert values.grad[0, 2].item() == pytest.approx(-1 / 3, abs=1e-6)


def test_bad_inputs_name_themselves():
    values, returns, old, mask = _tensors()
    with pytest.raises(ValueError, match=r"returns must be shaped like values \[1, 4\]"):
        value_loss_terms(values, returns[:, :3], old, mask, clip=0.2)
    with pytest.raises(ValueError, match="critic.value_clip"):
        value_loss_terms(values, returns, old, mask, clip=0.0)
    with pytest.raises(ValueError, match="mask selects no tokens"):
        clipped_value_loss(values, returns, old, torch.zeros_like(mask), clip=0.2)


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    # residuals R - V = [0, 0, 1]: var 1/3; var(R) = 1 -> 1 - 1/3
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(2 / 3)
    assert explained_variance(returns, returns, mask) == 1.0
    flat = torch.tensor([[1.0, 1.0, 1.0, 5.0]])
    assert explained_variance(values, flat, mask) != explained_variance(values, flat, mask)  # nan
