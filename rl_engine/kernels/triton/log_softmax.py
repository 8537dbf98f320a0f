"""Log-softmax on the GPU: fp32 logprobs of softmax(logits / temperature), one program per row.

THE logprob definition of the triton backend (the rollout engine and
`linear_logp` both call `log_softmax_forward`). A row is read in chunks of
BLOCK columns from column 0: pass 1 takes the max (exact in any order), pass 2
sums exp(x / T - max) into a BLOCK-wide fp32 vector reduced once at the end,
pass 3 writes x / T - max - log(sum). The order depends only on V. Backward:
plain torch, d logp = g - softmax * sum(g) (deterministic).

One binary for every call: no pointer or integer argument is specialised
(alignment would change the loads' layout, and with it which elements each
thread sums: a 1-row view of a wider buffer and a batch of rows would round
differently), so the layout is the same for every row count, offset, view
and vocabulary. Rounding on a GPU: x / T is IEEE division (`div_rn`, as torch
divides); exp and log are the hardware's approximations (`ex2.approx`,
`lg2.approx`, within a few ulp; tests/gpu checks the logprobs against fp64
within 1e-5 absolute at V = 151936), so the bits are this backend's own, not torch's.
fp64 logits: the temperature arrives as an fp32 scalar (Triton passes Python
floats as fp32); T = 1 and other values exact in fp32 lose nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.log_softmax import log_softmax_op
from rl_engine.kernels.triton._common import SERVING, div_rn, tl_dtype
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

_BLOCK = 2048  # chunk width (part of the numerics: the sum's order)


_NUM_WARPS = 8  # part of the numerics: the final tree sum over the BLOCK-wide vector
_ARGS = ["x_ptr", "out_ptr", "V", "stride_x", "stride_o"]


@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _log_softmax_kernel(
    x_ptr, out_ptr, V, stride_x, stride_o, temperature, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    m = tl.full((BLOCK,), float("-inf"), dtype=ACC)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(ACC)
        m = tl.maximum(m, div_rn(x, temperature, ACC))
    row_max = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=ACC)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(ACC)
        s += tl.exp(div_rn(x, temperature, ACC) - row_max)
    log_sum = tl.log(tl.sum(s, axis=0))
    for v0 in range(0, V, BLOCK):
        mask = v0 + offs < V
        x = tl.load(x_row + v0 + offs, mask=mask, other=0.0).to(ACC)
        tl.store(
            out_ptr + row * stride_o + v0 + offs,
            (div_rn(x, temperature, ACC) - row_max) - log_sum,
            mask=mask,
        )


def log_softmax_launch(logits2d: torch.Tensor, out: torch.Tensor, temperature: float) -> Launch:
    """The launch that writes out (M, V) = log_softmax(logits2d / temperature), one program a row."""
    M, V = logits2d.shape
    return Launch(
        variant="log_softmax",
        kernel=_log_softmax_kernel,
        grid=(M,),
        args=(logits2d, out, V, logits2d.stride(0), out.stride(0), float(temperature)),
        constexprs=dict(ACC=tl_dtype(out.dtype), BLOCK=_BLOCK),
        num_warps=_NUM_WARPS,
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


def log_softmax_forward(logits2d: torch.Tensor, temperature: float) -> torch.Tensor:
    """(M, V) -> (M, V) logprobs in the compute dtype (fp32; fp64 for fp64)."""
    logits2d = logits2d.contiguous()
    M, V = logits2d.shape
    acc = at_least_fp32(logits2d.dtype)
    out = torch.empty((M, V), dtype=acc, device=logits2d.device)
    if M == 0 or V == 0:
        return out
    log_softmax_launch(logits2d, out, temperature).run()
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


def apply_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (..., V) -> logprobs (..., V) in fp32 (fp64 for fp64), rows through the kernel."""
    out = _InvariantLogSoftmax.apply(logits.reshape(-1, logits.shape[-1]), temperature)
    return out.reshape(logits.shape)


log_softmax = log_softmax_op(apply_log_softmax, SERVING, __name__)
