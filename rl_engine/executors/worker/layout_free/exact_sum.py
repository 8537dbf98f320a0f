"""The exact sum of a layout-free metric's terms, which a non-finite value never makes raise."""

from __future__ import annotations

import math
from collections.abc import Iterable

_SCALE = 2.0**-64  # a power of two: scaling by it is exact for the magnitudes that overflow


def exact_sum(values: Iterable[float]) -> float:
    """math.fsum of `values` (exact, so in any order the same bits), except where fsum raises
    mid-step: +inf and -inf among the terms give NaN, an exact total beyond the float range
    gives inf of its sign, as float adds would report a non-finite step."""
    values = list(values)
    try:
        return math.fsum(values)
    except ValueError:  # +inf and -inf among the terms
        return math.nan
    except OverflowError:  # finite terms whose exact total is out of range
        return math.copysign(math.inf, math.fsum(v * _SCALE for v in values))
