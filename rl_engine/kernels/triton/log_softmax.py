"""Log-softmax on the GPU: fp32 logprobs of softmax(logits / temperature), one program per row.

THE logprob definition of the triton backend (the rollout engine and
`linear_logp` both call `log_softmax_forward`). A row is read in chunks of
BLOCK columns from column 0: pass 1 takes the max (exact in any order), pass 2
sums exp(x / T - max) into a BLOCK-wide fp32 vector reduced once at the end,
pass 3 writes x / T - max - log(sum). The order depends only on V. Backward:
plain torch, d logp = g - softmax * sum(g) (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.checks import at_least_fp32, check_floating, check_temperature
from rl_engine.kernels.triton._common import check_device, tl_dtype

_BLOCK = 2048  # chunk width (part of the numerics: the sum's order)


@triton.jit
def _log_softmax_kernel(
    x_ptr, out_ptr, V, stride_x, stride_o, temperature, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    m = tl.full((BLOCK,), float("-inf"), dtype=ACC)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(ACC)
        m = tl.maximum(m, x / temperature)
    row_max = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=ACC)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(ACC)
        s += tl.exp(x / temperature - row_max)
    log_sum = tl.log(tl.sum(s, axis=0))
    for v0 in range(0, V, BLOCK):
        mask = v0 + offs < V
        x = tl.load(x_row + v0 + offs, mask=mask, other=0.0).to(ACC)
        tl.store(
            out_ptr + row * stride_o + v0 + offs, (x / temperature - row_max) - log_sum, mask=mask
        )


def log_softmax_forward(logits2d: torch.Tensor, temperature: float) -> torch.Tensor:
    """(M, V) -> (M, V) logprobs in the compute dtype (fp32; fp64 for fp64)."""
    logits2d = logits2d.contiguous()
    M, V = logits2d.shape
    acc = at_least_fp32(logits2d.dtype)
    out = torch.empty((M, V), dtype=acc, device=logits2d.device)
    if M == 0 or V == 0:
        return out
    _log_softmax_kernel[(M,)](
        logits2d,
        out,
        V,
        logits2d.stride(0),
        out.stride(0),
        float(temperature),
        ACC=tl_dtype(acc),
        BLOCK=_BLOCK,
        num_warps=8,
    )
    return out


class _InvariantLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, temperature):
        out = log_softmax_forward(logits2d, temperature)
        ctx.save_for_backward(out)
        ctx.temperature, ctx.in_dtype = temperature, logits2d.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (logp,) = ctx.saved_tensors
        grad = grad_out - logp.exp() * grad_out.sum(-1, keepdim=True)
        return (grad / ctx.temperature).to(ctx.in_dtype), None


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> fp32 logprobs (..., V) of softmax(logits / temperature); fp64 stays fp64."""
    check_floating("logits", logits)
    temperature = check_temperature(temperature)
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dim (the vocabulary)")
    check_device("logits", logits)
    out = _InvariantLogSoftmax.apply(logits.reshape(-1, logits.shape[-1]), temperature)
    return out.reshape(logits.shape)
