"""exact_sum: math.fsum's exact sum, and the IEEE outcome where fsum would raise."""

from __future__ import annotations

import math

import pytest

from rl_engine.executors.worker.layout_free.exact_sum import exact_sum


def test_finite_terms_sum_exactly_in_any_order():
    terms = [1e16, 1.0, -1e16, 1.0, 0.1]
    assert exact_sum(terms) == math.fsum(terms) == 2.1
    assert exact_sum(reversed(terms)) == 2.1
    assert sum(terms) != 2.1  # the control: float adds in this order lose the ones


@pytest.mark.parametrize(
    ("terms", "expected"),
    [
        ([math.inf, 1.0, -math.inf], math.nan),
        ([1.0, math.nan], math.nan),
        ([math.inf, 2.0], math.inf),
        ([1e308, 1e308, -1.0], math.inf),
        ([-1e308, -1e308, 5.0], -math.inf),
    ],
    ids=["inf-minus-inf", "nan", "inf", "overflow", "negative-overflow"],
)
def test_non_finite_terms_give_the_ieee_result_instead_of_raising(terms, expected):
    got = exact_sum(terms)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_math_fsum_raises_where_exact_sum_does_not():
    for terms in ([math.inf, -math.inf], [1e308, 1e308]):  # the control: what fsum did mid-step
        with pytest.raises((ValueError, OverflowError)):
            math.fsum(terms)
        assert not math.isfinite(exact_sum(terms))
