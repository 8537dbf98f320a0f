"""rl_engine.exact.row_partial: a partial that touches some rows sums as the dense tensor it
stands for, bit for bit.

The chain checked: for random splits over ranks and micro-batches (tests/helpers/canonical_sums.py),
the canonical sum of row partials, densified == the canonical tree of their dense forms, also with
dense and row partials mixed; `add_rows` == the dense add, signed zeros included (compared as
integers). Negative control: a row copied from the one child that holds it keeps a -0.0 that
the dense add (and `add_rows`) turns into +0.0. Malformed rows are refused by name.
"""

import math
import random

import pytest
import torch

from rl_engine.exact.canonical_sum import CanonicalSum
from rl_engine.exact.row_partial import RowPartial, add_rows
from tests.helpers.canonical_sums import (
    adversarial_leaves,
    assert_same_bits,
    bits_of,
    canonical_nans,
    expected_sum,
    random_split,
    row_leaves,
    sum_split,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 24, 33])
def test_row_partials_sum_as_their_dense_forms(n, dtype):
    partials, dense = row_leaves(n, dtype, seed=n)
    want = expected_sum(dense)
    rng = random.Random(n)
    for _ in range(6):
        split = random_split(n, rng)
        got = sum_split(n, [RowPartial(p.rows, p.values.clone()) for p in partials], split, rng)
        assert_same_bits(got.densify(want.shape), want)
        mixed = [p if s % 3 else d.clone() for s, (p, d) in enumerate(zip(partials, dense))]
        mixed = [
            RowPartial(m.rows, m.values.clone()) if isinstance(m, RowPartial) else m for m in mixed
        ]
        got = sum_split(n, mixed, split, rng)
        got = got.densify(want.shape) if isinstance(got, RowPartial) else got
        assert_same_bits(got, want)


def test_a_row_in_one_child_gets_its_plus_zero():
    """-0.0 held by one child becomes +0.0 (the dense add's -0.0 + 0.0); inf and NaN stay."""
    left = RowPartial(torch.tensor([0, 2]), torch.tensor([[-0.0], [math.inf]]))
    right = RowPartial(torch.tensor([1, 2]), torch.tensor([[-0.0], [1.0]]))
    total = CanonicalSum(2)
    total.push(0, left)
    total.push(1, right)
    got = total.result().densify((4, 1))
    assert_same_bits(got, torch.tensor([[0.0], [0.0], [math.inf], [0.0]]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rows_is_the_dense_add(dtype):
    shape = (12, 5)
    values = adversarial_leaves(2, dtype, seed=3, shape=shape)
    left = RowPartial(torch.tensor([0, 2, 3, 7, 11]), values[0][[0, 2, 3, 7, 11]].clone())
    right = RowPartial(torch.tensor([1, 2, 7, 9]), values[1][[1, 2, 7, 9]].clone())
    want = left.densify(shape) + right.densify(shape)
    got = add_rows(left, right)
    assert got.rows.tolist() == [0, 1, 2, 3, 7, 9, 11]
    # a bf16 NaN's bits follow its place in the add: both sides' NaNs compared as 0x7FC0
    assert_same_bits(canonical_nans(got.densify(shape)), canonical_nans(want))
    # negative control: row 4, held by one child only, is that child's -0.0 copied, but
    # -0.0 + 0.0 (+0.0) added
    solo = RowPartial(torch.tensor([4]), torch.full((1, 5), -0.0, dtype=dtype))
    copied, added = solo.densify(shape)[4], add_rows(solo, right).densify(shape)[4]
    assert torch.equal(bits_of(added), bits_of(torch.zeros(5, dtype=dtype)))
    assert not torch.equal(bits_of(copied), bits_of(added))


def test_add_rows_of_the_same_rows_adds_in_place():
    left = RowPartial(torch.tensor([1, 3]), torch.tensor([[1.0], [2.0]]))
    right = RowPartial(torch.tensor([1, 3]), torch.tensor([[0.5], [-2.0]]))
    got = add_rows(left, right)
    assert got.values.data_ptr() == left.values.data_ptr()
    assert torch.equal(got.values, torch.tensor([[1.5], [0.0]]))


def test_malformed_rows_are_refused_by_name():
    with pytest.raises(ValueError, match="sorted, unique"):
        RowPartial(torch.tensor([2, 1]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sorted, unique and >= 0"):
        RowPartial(torch.tensor([-1, 1]), torch.zeros(2, 3))
    with pytest.raises(
        ValueError, match=r"rows must be a 1-d int64 tensor, got torch.int32 \(2,\)"
    ):
        RowPartial(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"one row per index: 2 rows, values \(3, 3\)"):
        RowPartial(torch.tensor([0, 1]), torch.zeros(3, 3))
    part = RowPartial(torch.tensor([0, 4]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"rows of shape \(3,\) do not fit \(5, 2\)"):
        part.densify((5, 2))
    with pytest.raises(ValueError, match=r"row 4 is outside the 4 rows of \(4, 3\)"):
        part.densify((4, 3))
