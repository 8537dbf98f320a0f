"""The layout-free gradient and its norm (executors/worker/layout_free/grads.py), in-process on
one rank (the multi-rank broadcasts: layout_free/test_update.py).

Equality chain of the norm: `global_norm` of the gradients == of the same gradients in reverse
order == of them reshaped == with the fp64 squares formed one row at a time, as floats with ==.
Negative control: float32's own sum of the squares, forward against reversed, gives other bits.
On one rank the whole gradient is the sink's canonical tree, dense and row roles added; a range
that is not the sink's is refused by name, as is a gradient of the wrong shape. The clip
coefficient is torch's clip_grad_norm_'s, None when off, within the bound or NaN."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.exact.sequence_gradients import SequenceGradients
from rl_engine.executors.worker.layout_free import grads
from rl_engine.executors.worker.layout_free.grads import (
    NORM_ROW,
    clip_coefficient,
    global_norm,
    inject_gradient,
    row_square_sums,
    whole_gradient,
    whole_gradients,
)
from tests.helpers.canonical_sums import adversarial_leaves, assert_same_bits, reference_sum


def _gradients() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(3 * NORM_ROW + 17) * 1e3, torch.randn(5, 7), torch.randn(NORM_ROW)]


def test_the_norm_does_not_depend_on_order_shape_or_blocking(monkeypatch):
    gradients = _gradients()
    norm = global_norm(gradients)
    assert norm == global_norm(gradients[::-1])
    assert norm == global_norm([g.reshape(-1, 1) for g in gradients])
    monkeypatch.setattr(grads, "NORM_ROWS_AT_ONCE", 1)
    assert norm == global_norm(gradients)
    squared = sum(float(g.double().square().sum()) for g in gradients)
    assert math.isclose(norm, math.sqrt(squared), rel_tol=1e-12)
    # negative control: float32's sum of the squares in order drops what the reverse keeps
    large, ones = torch.tensor([1e4]), torch.ones(8)  # 1e8 + 1 rounds to 1e8 in float32
    squares = [large.square().sum(), *ones.square()]
    forward = backward = torch.zeros(())
    for term in squares:
        forward = forward + term
    for term in squares[::-1]:
        backward = backward + term
    assert not torch.equal(forward, backward)
    assert global_norm([large, ones]) == global_norm([ones, large]) == math.sqrt(1e8 + 8)


def test_a_gradients_norm_terms_are_one_per_row_and_the_tail():
    grad = torch.full((2 * NORM_ROW + 3,), 2.0)
    assert row_square_sums(grad) == [4.0 * NORM_ROW, 4.0 * NORM_ROW, 12.0]


def test_clip_coefficient_is_torchs_or_none():
    assert clip_coefficient(3.0, 1.0) == 1.0 / (3.0 + 1e-6)
    assert clip_coefficient(0.5, 1.0) is None  # within the bound
    assert clip_coefficient(3.0, 0.0) is None  # clipping off
    assert clip_coefficient(math.nan, 1.0) is None


def test_one_ranks_whole_gradient_is_the_sinks_tree_of_every_role():
    n, shape = 5, (6, 4)
    weight = torch.zeros(shape)
    dense = adversarial_leaves(n, torch.float32, seed=2, shape=shape)
    rows = torch.tensor([1, 4])
    sink = SequenceGradients(n, 0, n)
    for s in range(n):
        sink.add(weight, "lm_head", s, dense[s].clone())
        sink.add_rows(weight, "embedding", s, rows, dense[s][rows].clone())
    (got,) = whole_gradients(sink, [weight], [(0, n)])
    from_rows = torch.zeros(shape)
    from_rows[rows] = reference_sum([d[rows] for d in dense], 0, n)
    assert_same_bits(got, from_rows + reference_sum(dense, 0, n))  # roles in sorted order


def test_a_range_that_is_not_the_sinks_is_refused():
    sink = SequenceGradients(4, 0, 4)
    with pytest.raises(ValueError, match=r"rank 0 holds \[0, 4\), ranges say \(0, 2\)"):
        whole_gradient(sink, torch.zeros(2), [(0, 2), (2, 4)])


def test_a_gradient_of_the_wrong_shape_is_refused_by_index():
    param = torch.nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"gradient 7 has shape \(3, 2\), its parameter \(2, 3\)"):
        inject_gradient(param, torch.zeros(3, 2), 7)


def test_a_parameter_with_nowhere_to_write_is_refused_and_a_grad_is_written():
    """DeepSpeed's safe_set_full_grad silently writes nothing for a parameter with neither a
    .grad nor a ZeRO partition: the injection refuses it by index instead."""
    param = torch.nn.Parameter(torch.ones(3, 2))
    with pytest.raises(
        grads.GradientInjectionError, match=r"parameter 4 \(3, 2\): neither a .grad"
    ):
        inject_gradient(param, torch.full((3, 2), 2.0), 4)
    param.grad = torch.zeros(3, 2)  # control: a .grad (ZeRO-0's) is written in place
    inject_gradient(param, torch.full((3, 2), 2.0), 4)
    assert torch.equal(param.grad, torch.full((3, 2), 2.0))
