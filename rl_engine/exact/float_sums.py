"""Exact float sums: `exact_sum` of a list, and per-sequence row sums whose bits only the
sequence defines (trainer.layout_invariant). Every exact float sum of the package is one of these.

torch's `x.sum(dim=1)` over a (B, T) row adds in an order set by T and by the kernel's
vector width, so the same sequence padded to another length (another micro-batch) or packed
may sum to other bits. Here a row's sum is `math.fsum` of its kept values: the exact sum
rounded once to fp64, whatever their order, their padding or the row's batch mates. GSPO's
sequence log-ratio and the sequence-level rollout corrections take it under the mode.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def exact_row_sums(values: Tensor, keep: Tensor) -> Tensor:
    """(B, 1) fp64: each row's exact sum of `values` where `keep` (no gradient)."""
    if values.dim() != 2 or values.shape != keep.shape:
        raise ValueError(
            f"exact_row_sums takes 2-D values and keep of one shape, got {list(values.shape)} "
            f"and {list(keep.shape)}"
        )
    rows = values.detach().double().cpu()
    live = (keep != 0).cpu()
    sums = [exact_sum(rows[r][live[r]].tolist()) for r in range(rows.shape[0])]
    return torch.tensor(sums, dtype=torch.float64, device=values.device)[:, None]


def exact_row_means(values: Tensor, keep: Tensor) -> Tensor:
    """(B, 1) fp32: each row's mean over `keep` from its exact sum (an empty row: 0)."""
    counts = (keep != 0).sum(dim=1, keepdim=True).clamp(min=1).double()
    return (exact_row_sums(values, keep) / counts).float()


def exact_sum(values) -> float:
    """The correctly rounded sum of `values` (math.fsum: the same bits in any order or grouping),
    with inf and NaN propagated as float adds would (a bare fsum raises on inf - inf and on an
    intermediate overflow, where a float add gives inf or NaN)."""
    values = list(values)
    if not all(math.isfinite(v) for v in values):
        return sum(v for v in values if not math.isfinite(v))
    try:
        return math.fsum(values)
    except OverflowError:
        # The exact sum is past the largest float: it rounds to an infinity of its sign, which
        # the scaled sum (exact: a power-of-two scale) still has.
        return math.copysign(math.inf, math.fsum(v * 2.0**-64 for v in values))
