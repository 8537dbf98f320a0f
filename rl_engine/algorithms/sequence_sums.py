"""Per-sequence reductions whose bits only the sequence defines (trainer.layout_invariant).

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
    sums = [_fsum(rows[r][live[r]].tolist()) for r in range(rows.shape[0])]
    return torch.tensor(sums, dtype=torch.float64, device=values.device)[:, None]


def exact_row_means(values: Tensor, keep: Tensor) -> Tensor:
    """(B, 1) fp32: each row's mean over `keep` from its exact sum (an empty row: 0)."""
    counts = (keep != 0).sum(dim=1, keepdim=True).clamp(min=1).double()
    return (exact_row_sums(values, keep) / counts).float()


def _fsum(values: list[float]) -> float:
    """math.fsum, with inf and NaN propagated as float adds would (fsum raises on inf - inf)."""
    if all(math.isfinite(v) for v in values):
        return math.fsum(values)
    return sum(v for v in values if not math.isfinite(v))
