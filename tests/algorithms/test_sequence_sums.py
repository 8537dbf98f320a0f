"""The exact per-sequence reduction (rl_engine/exact/float_sums.py) and the two places
trainer.layout_invariant takes it: GSPO's sequence log-ratio and the sequence-level rollout
corrections. A sequence's bits must not depend on its row's padding, its column offset or its
batch mates; torch's padded-row sum (the plain path) does, for some lengths."""

from __future__ import annotations

import pytest
import torch

from rl_engine.algorithms import policy_loss_terms, rollout_correction
from rl_engine.exact.float_sums import exact_row_means, exact_row_sums

LENGTHS = range(1, 64)


def _values(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.3


def _placed(x: torch.Tensor, width: int, offset: int, mates: int, seed: int):
    """(values, keep) of `mates + 1` rows of `width`: `x` at row `mates` from column `offset`,
    random batch mates above it (their own lengths), garbage at every masked place."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(mates + 1, width, generator=g) * 100.0
    keep = torch.zeros(mates + 1, width, dtype=torch.bool)
    for row in range(mates):
        keep[row, : int(torch.randint(1, width + 1, (1,), generator=g))] = True
    values[mates, offset : offset + len(x)] = x
    keep[mates, offset : offset + len(x)] = True
    return values, keep


LAYOUTS = [(0, 0), (0, 3), (5, 1), (17, 2)]  # (extra padding, column offset)


def _layouts(x: torch.Tensor, seed: int):
    for pad, offset in LAYOUTS:
        yield _placed(x, offset + len(x) + pad, offset, mates=offset, seed=seed + pad)


@pytest.mark.parametrize("n", [1, 7, 12, 31, 50])
def test_a_rows_exact_sum_and_mean_do_not_depend_on_its_layout(n):
    x = _values(n, seed=n)
    sums = [exact_row_sums(v, k)[-1] for v, k in _layouts(x, seed=n)]
    means = [exact_row_means(v, k)[-1] for v, k in _layouts(x, seed=n)]
    assert all(torch.equal(s, sums[0]) for s in sums)
    assert all(torch.equal(m, means[0]) for m in means)
    shuffled = x[torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    assert torch.equal(exact_row_sums(shuffled[None], torch.ones(1, n))[0], sums[0])
    assert means[0].dtype == torch.float32 and sums[0].dtype == torch.float64


def test_negative_control_torchs_padded_row_sum_depends_on_the_padding():
    differ = []
    for n in LENGTHS:
        x = _values(n, seed=n)
        plain = [torch.where(k, v, 0.0).sum(dim=1)[-1] for v, k in _layouts(x, seed=n)]
        if not all(torch.equal(p, plain[0]) for p in plain):
            differ.append(n)
    assert differ, "torch's padded-row sum kept its bits at every length: no control"


def test_non_finite_values_propagate_instead_of_raising():
    values = torch.tensor([[1.0, float("inf"), -float("inf")], [2.0, float("nan"), 0.0]])
    sums = exact_row_sums(values, torch.ones(2, 3, dtype=torch.bool))
    assert sums[0].isnan().all() and sums[1].isnan().all()
    empty = exact_row_means(values, torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(2, 1))


def _gspo_row(x_new: torch.Tensor, x_old: torch.Tensor, pad: int, offset: int, exact: bool):
    """(per-token terms, logprob gradient) of the last row's tokens in a layout."""
    n = len(x_new)
    new, keep = _placed(x_new, offset + n + pad, offset, mates=offset, seed=pad)
    old, _ = _placed(x_old, offset + n + pad, offset, mates=offset, seed=pad + 50)
    new.requires_grad_(True)
    adv = torch.linspace(-1.0, 1.0, new.shape[0]).flip(0)  # the last row: -1.0 in every layout
    terms = policy_loss_terms(
        new, old, adv, keep, clip_eps=0.2, ratio_level="sequence", exact_sequences=exact
    )
    terms.per_token.sum().backward()
    cols = slice(offset, offset + n)
    return terms.per_token[-1, cols].detach(), new.grad[-1, cols]


@pytest.mark.parametrize("n", [7, 12, 31])
def test_gspo_terms_and_gradients_of_a_sequence_do_not_depend_on_its_layout(n):
    x_new, x_old = _values(n, seed=n) - 2.0, _values(n, seed=n + 100) - 2.0
    runs = [_gspo_row(x_new, x_old, pad, offset, exact=True) for pad, offset in LAYOUTS]
    for terms, grad in runs[1:]:
        assert torch.equal(terms, runs[0][0])
        assert torch.equal(grad, runs[0][1])
    assert runs[0][1].abs().sum() > 0


def test_negative_control_plain_gspo_terms_depend_on_the_layout():
    differ = []
    for n in LENGTHS:
        x_new, x_old = _values(n, seed=n) - 2.0, _values(n, seed=n + 100) - 2.0
        runs = [_gspo_row(x_new, x_old, pad, offset, exact=False) for pad, offset in LAYOUTS]
        if not all(torch.equal(terms, runs[0][0]) for terms, _ in runs):
            differ.append(n)
    assert differ


def test_exact_gspo_is_the_plain_gspo_up_to_rounding():
    x_new, x_old = _values(31, seed=3) - 2.0, _values(31, seed=4) - 2.0
    exact = _gspo_row(x_new, x_old, 5, 1, exact=True)
    plain = _gspo_row(x_new, x_old, 5, 1, exact=False)
    for a, b in zip(exact, plain):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_corrections_do_not_depend_on_the_layout(mode):
    n = 31
    x_trainer, x_rollout = _values(n, seed=7) * 0.1, _values(n, seed=8) * 0.1
    runs = []
    for pad, offset in LAYOUTS:
        trainer, keep = _placed(x_trainer, offset + n + pad, offset, mates=offset, seed=pad)
        rollout, _ = _placed(x_rollout, offset + n + pad, offset, mates=offset, seed=pad + 9)
        c = rollout_correction(trainer, rollout, keep, mode=mode, threshold=1.5, exact=True)
        cols = slice(offset, offset + n)
        runs.append((c.weights[-1, cols], c.mask[-1, cols]))
    for weights, mask in runs[1:]:
        assert torch.equal(weights, runs[0][0]) and torch.equal(mask, runs[0][1])
    assert not torch.equal(runs[0][0], torch.ones(n))  # the correction acts
