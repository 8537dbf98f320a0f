"""Fused, chunked per-token logprobs on the GPU: log_softmax(lm_head(hidden) / T) gathered at the targets.

Forward walks the tokens in chunks, so at most `chunk_rows x V` logits exist at
a time. Each chunk runs the very same kernels as the triton `lm_head` and
`log_softmax` ops the rollout engine calls on its decode batch (the persistent
fixed-order matmul and the one-program-per-row log-softmax); both are
row-invariant, so fused == unfused bitwise, whatever the chunk size. Backward
recomputes each chunk's softmax with those kernels and finishes with plain
torch GEMMs (deterministic): d logp[t] / d logits = (onehot(t) - softmax) / T.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.native._checks import at_least_fp32
from rl_engine.kernels.native.linear_logp import _validate
from rl_engine.kernels.native.log_softmax import check_temperature
from rl_engine.kernels.triton._common import check_device
from rl_engine.kernels.triton._matmul import BLOCK_M, fixed_order_matmul
from rl_engine.kernels.triton.log_softmax import log_softmax_forward

# Logits held at once, in elements: 16M = 64 MiB per fp32 buffer (logits and logprobs).
# Only memory and speed depend on it, never the bits.
CHUNK_ELEMENTS = 16 * 1024 * 1024


def chunk_rows_for(vocab_size: int) -> int:
    """Rows per chunk: a multiple of the matmul's row tile, at least one tile."""
    rows = CHUNK_ELEMENTS // max(vocab_size, 1)
    return max(BLOCK_M, rows // BLOCK_M * BLOCK_M)


def _chunk_logprobs(h, weight, bias, temperature):
    logits = fixed_order_matmul(h, weight, bias, out_dtype=at_least_fp32(h.dtype))  # (n, V)
    return log_softmax_forward(logits, temperature)  # (n, V) fp32


def linear_logp_forward(hidden, weight, bias, targets, temperature, ignore_index):
    n = hidden.shape[0]
    out = torch.zeros(n, dtype=at_least_fp32(hidden.dtype), device=hidden.device)  # (N,)
    live = targets != ignore_index
    safe_targets = torch.where(live, targets, torch.zeros_like(targets))
    step = chunk_rows_for(weight.shape[0])
    for start in range(0, n, step):
        stop = min(start + step, n)
        logp = _chunk_logprobs(hidden[start:stop], weight, bias, temperature)
        picked = logp.gather(1, safe_targets[start:stop, None]).squeeze(1)
        out[start:stop] = torch.where(live[start:stop], picked, torch.zeros_like(picked))
    return out


def linear_logp_backward(grad_out, hidden, weight, bias, targets, temperature, ignore_index):
    n, vocab = hidden.shape[0], weight.shape[0]
    live = targets != ignore_index
    safe_targets = torch.where(live, targets, torch.zeros_like(targets))
    acc = at_least_fp32(weight.dtype)
    coeff = torch.where(live, grad_out.to(acc), torch.zeros_like(grad_out, dtype=acc))
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if bias is not None else None
    step = chunk_rows_for(vocab)
    for start in range(0, n, step):
        stop = min(start + step, n)
        h = hidden[start:stop]  # (n, H)
        probs = _chunk_logprobs(h, weight, bias, temperature).exp_()  # (n, V)
        grad_logits = probs.neg_()
        grad_logits.scatter_add_(1, safe_targets[start:stop, None], torch.ones_like(probs[:, :1]))
        grad_logits.mul_(coeff[start:stop, None] / temperature)  # (n, V)
        g = grad_logits.to(weight.dtype)
        grad_hidden[start:stop] = (g @ weight).to(hidden.dtype)
        grad_weight += g.t() @ h.to(weight.dtype)
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
    grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


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
    """hidden (..., H), weight (V, H), targets (...) -> fp32 logprobs (...), 0 where ignored.

    fp64 inputs give fp64 logprobs (for gradcheck); every other dtype gives fp32.
    """
    _validate(hidden, weight, targets, bias, ignore_index)
    check_device("hidden", hidden)
    temperature = check_temperature(temperature)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    out = _LinearLogp.apply(h2d, weight, bias, flat_targets, temperature, ignore_index)
    return out.reshape(targets.shape)
