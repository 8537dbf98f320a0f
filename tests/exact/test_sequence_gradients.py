"""rl_engine.exact.sequence_gradients: the per-sequence gradient sink gives the canonical
tree's bits however its sequences are split over holders.

The chain checked: ranks' holders combined == one holder == tree(embedding) + tree(lm_head)
(roles sorted) for a tied weight written dense and in rows, and the plain tree for a plain
weight, compared as integers over adversarial leaves (tests/helpers/canonical_sums.py). A
partial of the wrong shape, dtype or row, a missing or out-of-order sequence are refused by name.
"""

import pytest
import torch

from rl_engine.exact.canonical_sum import combine, depth, sum_roles
from rl_engine.exact.sequence_gradients import SequenceGradients
from tests.helpers.canonical_sums import (
    adversarial_leaves,
    assert_same_bits,
    reference_sum,
    row_leaves,
)


def test_sequence_gradients_split_over_ranks_equal_one_holder_and_the_trees():
    """A tied weight written as 'lm_head' (dense) and 'embedding' (rows), and a plain weight:
    ranks' holders combined == one holder == tree(embedding) + tree(lm_head) (roles sorted)."""
    n, shape = 13, (40, 9)
    tied, other = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(3, 2)
    rows, dense_rows = row_leaves(n, torch.float32, seed=5)
    heads = adversarial_leaves(n, torch.float32, seed=6, shape=shape)
    others = adversarial_leaves(n, torch.float32, seed=8, shape=(3, 2))

    def holder(lo, hi):
        sink = SequenceGradients(n, lo, hi)
        for s in range(lo, hi):
            sink.add(tied, "lm_head", s, heads[s].clone())
            sink.add_rows(tied, "embedding", s, rows[s].rows, rows[s].values.clone())
            sink.add(other, "linear", s, others[s].clone())
        return sink

    whole = holder(0, n)
    assert [id(p) for p in whole.params()] == [id(tied), id(other)]
    assert whole.roles(tied) == ["embedding", "lm_head"]
    want = reference_sum(dense_rows, 0, n) + reference_sum(heads, 0, n)
    assert_same_bits(whole.result(tied), want)
    assert_same_bits(whole.result(other), reference_sum(others, 0, n))
    ranks = [holder(0, 5), holder(5, 6), holder(6, 13)]
    assert sum(rank.held() for rank in ranks) <= 3 * 3 * (2 * depth(n) + 1)
    for param, expected in ((tied, want), (other, reference_sum(others, 0, n))):
        covers = [rank.nodes(param) for rank in ranks]
        roots = {role: combine(n, [nd for c in covers for nd in c[role]]) for role in covers[0]}
        assert_same_bits(sum_roles(param.shape, roots), expected)


def test_sequence_gradients_errors():
    param = torch.zeros(4, 3)
    sink = SequenceGradients(6, 2, 5)
    with pytest.raises(ValueError, match=r"shape \(3,\) for a parameter of \(4, 3\)"):
        sink.add(param, "linear", 2, torch.zeros(3))
    with pytest.raises(ValueError, match="is torch.float32 there, got torch.float64"):
        sink.add(param, "linear", 2, torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="row 4 is outside the parameter's 4 rows"):
        sink.add_rows(param, "embedding", 2, torch.tensor([4]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="no partial was written"):
        sink.nodes(param)
    sink.add(param, "linear", 2, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"lacks the partials of sequences \[3, 5\)"):
        sink.nodes(param)
    with pytest.raises(ValueError, match=r"expected index 3, got 4"):
        sink.add(param, "linear", 4, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"holder has sequences \[2, 5\) of 6"):
        sink.result(param)
