"""RMSNorm with Hugging Face semantics: fp32 statistics, normalised value cast back, then * weight.

The only reduction is a mean over each row's last dim. Torch reduces such rows
one at a time, in an order set by the row length, except when the whole
reduction has a single output: then, for long rows, it splits the row across
threads. One-row inputs are therefore duplicated to two rows first.
Backward: autograd through the same torch ops (deterministic).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.rms_norm import rms_norm_op
from rl_engine.kernels.native._serving import PLAIN


def _mean_square(x32: torch.Tensor) -> torch.Tensor:
    rows = x32.reshape(-1, x32.shape[-1])  # (M, H)
    if rows.shape[0] == 1:
        return rows.expand(2, -1).pow(2).mean(-1, keepdim=True)[:1].reshape(*x32.shape[:-1], 1)
    return x32.pow(2).mean(-1, keepdim=True)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(at_least_fp32(x.dtype))
    normed = x32 * torch.rsqrt(_mean_square(x32) + eps)
    return weight * normed.to(x.dtype)


rms_norm = rms_norm_op(rms_norm_forward, PLAIN, __name__)
