"""Batch-invariant linear layer on the GPU: y = x @ W^T + b through the persistent fixed-order matmul.

Forward: `_matmul.fixed_order_matmul` (constant tiles, no split-K, fp32
accumulation, bias added in fp32 before the single rounding to x.dtype), so a
row's bits do not depend on M, its position or the other rows. Backward: plain
torch GEMMs, deterministic run to run, not batch-invariant (gradients are
summed over the batch anyway), shared with every backend (rl_engine/kernels/common/linear.py).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.linear import (
    invariant_linear_function,
    linear_backward,  # noqa: F401  (the op's backward)
    project,
)
from rl_engine.kernels.triton._common import check_device
from rl_engine.kernels.triton._matmul import fixed_order_matmul


def linear_forward(x2d, weight, bias, out_dtype):
    return fixed_order_matmul(x2d, weight, bias, out_dtype=out_dtype)  # (M, N)


_InvariantLinear = invariant_linear_function(linear_forward, __name__)


def apply_projection(x, weight, bias, out_dtype):
    """Shared by `linear` and `lm_head`: validate, flatten the rows, project."""
    return project(_InvariantLinear, x, weight, bias, out_dtype, check_device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype."""
    return apply_projection(x, weight, bias, x.dtype)
