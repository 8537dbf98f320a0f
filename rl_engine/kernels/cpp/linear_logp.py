"""Fused, chunked per-token logprobs on CPU: log_softmax(lm_head(hidden) / T) at the targets.

The native op's algorithm, code and contract (rl_engine.kernels.native.linear_logp):
each chunk of tokens calls this backend's `lm_head` (the fixed-order GEMM,
M-independent by construction) and the shared `log_softmax`, so the result is
bitwise equal to materialising all logits, whatever the chunk size. What
changes is the chunk: the fixed-order GEMM packs (streams) the whole LM-head
weight once per call for a chunk of up to 480 rows, so chunks are a multiple
of 48 rows and as large as the memory target allows (CHUNK_ELEMENTS logits at
a time).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.cpp.linear import lm_head
from rl_engine.kernels.native.linear_logp import _validate
from rl_engine.kernels.native.linear_logp import linear_logp_backward as native_backward
from rl_engine.kernels.native.linear_logp import linear_logp_forward as native_forward
from rl_engine.kernels.native.log_softmax import check_temperature

# Logits held at once, in elements: 14M = 56 MiB per fp32 buffer (298 rows at
# a 49152 vocabulary, rounded down to 288, a multiple of ROW_ALIGN); the op
# holds about three such buffers (logits, log_softmax, its temporaries): peak
# extra memory 0.11x of materialising 4096 x 49152 fp32 logits (16M: 0.126x,
# over the 1/8 target). A chunk of up to 480 rows (the GEMM's row block)
# packs each 256-column weight block once, in L2, so the weight is streamed
# once per chunk: larger chunks amortise it. ROW_ALIGN is a multiple of the
# 6-row register tile. Only speed and memory depend on these, never the bits.
CHUNK_ELEMENTS = 14 * 1024 * 1024
ROW_ALIGN = 48
MAX_CHUNK_ROWS = 1024


def chunk_rows_for(vocab_size: int) -> int:
    rows = min(MAX_CHUNK_ROWS, CHUNK_ELEMENTS // max(vocab_size, 1))
    return max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)


def linear_logp_forward(hidden, weight, bias, targets, temperature, ignore_index):
    step = chunk_rows_for(weight.shape[0])
    return native_forward(
        hidden, weight, bias, targets, temperature, ignore_index, project=lm_head, step=step
    )


def linear_logp_backward(grad_out, hidden, weight, bias, targets, temperature, ignore_index):
    step = chunk_rows_for(weight.shape[0])
    return native_backward(
        grad_out,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        ignore_index,
        project=lm_head,
        step=step,
    )


class _LinearLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index):
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        return linear_logp_forward(hidden, weight, bias, targets, temperature, ignore_index)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        grads = linear_logp_backward(
            grad_out, hidden, weight, bias, targets, ctx.temperature, ctx.ignore_index
        )
        grad_hidden, grad_weight, grad_bias = grads
        return (
            grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if ctx.needs_input_grad[1] else None,
            grad_bias if ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
        )


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """hidden (..., H), weight (V, H), targets (...) -> fp32 logprobs (...), 0 where ignored."""
    _validate(hidden, weight, targets, bias, ignore_index)
    temperature = check_temperature(temperature)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    out = _LinearLogp.apply(h2d, weight, bias, flat_targets, temperature, ignore_index)
    return out.reshape(targets.shape)
