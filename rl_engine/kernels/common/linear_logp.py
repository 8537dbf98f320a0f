"""The `linear_logp` op, written once: the chunked linear -> logprob algorithm around a backend's chunk.

Forward walks the tokens in chunks of `chunk_rows_for(V)` rows, so at most
`chunk_rows x V` logits exist at a time. Each chunk's logprobs come from the
backend's `chunk_logprobs(h, weight, bias, temperature)`, which must run the
very same kernels as its `lm_head` and `log_softmax` ops (the ones the rollout
engine calls on its decode batch); both are row-invariant, so fused ==
unfused bitwise, whatever the chunk size. Only memory and speed depend on
the chunk size, never the bits.

Backward recomputes each chunk's softmax with `chunk_logprobs` and finishes
with plain torch GEMMs (deterministic, not batch-invariant):
d logp[t] / d logits = (onehot(t) - softmax) / T. The weight's gradient is the
sum over chunks of `g.t() @ h`, each product in the weight's dtype, summed in at
least fp32 in chunk order and rounded once (`WeightGradient`); it is formed a
block of vocabulary rows at a time, so no V x H temporary exists beside the sum.
With `spans=` and `sink=` the backward is the layout-invariant one instead
(common/linear_logp_sequences.py): per-sequence head partials to the sink.
"""

from __future__ import annotations

from functools import partial

import torch

from rl_engine.kernels.common.checks import (
    at_least_fp32,
    check_index_range,
    check_projection,
    check_temperature,
)
from rl_engine.kernels.common.linear_logp_sequences import (
    check_targets_covered,
    sequence_logp_backward,
)
from rl_engine.kernels.common.op import Serving, define_op
from rl_engine.kernels.common.sequence_spans import check_sequence_mode, placeholder_grad


def chunked_logp_forward(
    chunk_logprobs, chunk_rows_for, hidden, weight, bias, targets, temperature, ignore_index
):
    n = hidden.shape[0]
    out = torch.zeros(n, dtype=at_least_fp32(hidden.dtype), device=hidden.device)  # (N,)
    live = targets != ignore_index
    safe_targets = torch.where(live, targets, torch.zeros_like(targets))
    step = chunk_rows_for(weight.shape[0])
    for start in range(0, n, step):
        stop = min(start + step, n)
        logp = chunk_logprobs(hidden[start:stop], weight, bias, temperature)
        picked = logp.gather(1, safe_targets[start:stop, None]).squeeze(1)
        out[start:stop] = torch.where(live[start:stop], picked, torch.zeros_like(picked))
    return out


def chunked_logp_backward(
    chunk_logprobs,
    chunk_rows_for,
    grad_out,
    hidden,
    weight,
    bias,
    targets,
    temperature,
    ignore_index,
    needs=(True, True, True),
    deferred=None,
):
    """(grad hidden, grad weight, grad bias); `needs` (ctx.needs_input_grad of the three): a
    frozen weight or bias gets None, and no V x H accumulator or product is made for it.
    `deferred` (a list): when the weight's gradient is still in parts that take no more memory
    than it (`WeightGradient.deferrable`), its grad is None and `deferred` gets the callable
    that forms it (the linear_logp op's `deferred_weight_grad`)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    needs_weight, needs_bias = needs[1], needs[2] and bias is not None
    live = targets != ignore_index
    safe_targets = torch.where(live, targets, torch.zeros_like(targets))
    acc = at_least_fp32(weight.dtype)
    coeff = torch.where(live, grad_out.to(acc), torch.zeros_like(grad_out, dtype=acc))
    grad_hidden = torch.empty_like(hidden)
    grad_weight = WeightGradient(weight, n) if needs_weight else None
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if needs_bias else None
    step = chunk_rows_for(vocab)
    for start in range(0, n, step):
        stop = min(start + step, n)
        h = hidden[start:stop]  # (n, H)
        probs = chunk_logprobs(h, weight, bias, temperature).exp_()  # (n, V)
        grad_logits = probs.neg_()
        grad_logits.scatter_add_(1, safe_targets[start:stop, None], torch.ones_like(probs[:, :1]))
        grad_logits.mul_(coeff[start:stop, None] / temperature)  # (n, V)
        g = grad_logits.to(weight.dtype)
        grad_hidden[start:stop] = (g @ weight).to(hidden.dtype)
        if grad_weight is not None:
            grad_weight.add(g, h.to(weight.dtype))
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
    if grad_weight is not None and deferred is not None and grad_weight.deferrable():
        deferred.append(grad_weight.result)
        grad_weight = None
    elif grad_weight is not None:
        grad_weight = grad_weight.result()
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


# Vocabulary rows per block of the weight's gradient, at most: an fp32 block of 16384 x 896
# (the 0.5B shape) is 56 MiB, above glibc's largest mmap threshold (32 MiB), so a freed
# block goes straight back to the OS. The blocks split the vocabulary evenly, so none is
# small: torch's fp32 GEMM gave other bits for a 7-row block of a product than for the same
# rows of the whole product (at 64 rows and more, and in bf16, the same bits in the tests).
GRAD_BLOCK_ROWS = 16384


def _row_blocks(rows: int) -> list[tuple[int, int]]:
    count = max(1, -(-rows // GRAD_BLOCK_ROWS))
    edges = [rows * i // count for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


class WeightGradient:
    """sum over the chunks of `g.t() @ h` (g (n, V), h (n, H), both in the weight's dtype):
    each product rounded to that dtype, added in at least fp32 in chunk order, the sum
    rounded once to the weight's dtype: what one full-size fp32 accumulator gives, bit for
    bit where torch's GEMM gives a block of rows of a product the bits of the product of
    that block (measured at blocks of 64 rows and more; `GRAD_BLOCK_ROWS`).

    Memory: a batch whose chunks' `g` take no more than that accumulator would (n x V x
    itemsize <= V x H x fp32 size: n <= 2H in bf16) keeps them and sums block by block
    at the end, so the only V x H buffer is the result. A larger batch sums into blocks
    of the accumulator as the chunks come, and rounds and frees it block by block.
    """

    def __init__(self, weight: torch.Tensor, rows: int):
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device
        self.acc = at_least_fp32(weight.dtype)
        vocab, hidden = weight.shape
        acc_bytes = vocab * hidden * torch.empty((), dtype=self.acc).element_size()
        self.parts = []  # (g, h) of each chunk, while they fit the accumulator's size
        self.blocks = None  # the accumulator, one tensor per row block
        self.rows = rows
        if rows * vocab * weight.element_size() > acc_bytes:
            self.blocks = [self._zeros(stop - start) for start, stop in _row_blocks(vocab)]

    def deferrable(self) -> bool:
        """Whether the gradient is held as its chunks' (g, h) taking no more memory than the
        gradient itself (rows <= H): forming it later holds less until then."""
        return self.blocks is None and self.rows <= self.shape[1]

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, self.shape[1]), dtype=self.acc, device=self.device)

    def add(self, g: torch.Tensor, h: torch.Tensor) -> None:
        if self.blocks is None:
            self.parts.append((g, h))
            return
        for block, (start, stop) in zip(self.blocks, _row_blocks(self.shape[0])):
            block += g[:, start:stop].t() @ h

    def result(self) -> torch.Tensor:
        if self.blocks is not None and len(self.blocks) == 1 and self.acc == self.dtype:
            return self.blocks[0]
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for index, (start, stop) in enumerate(_row_blocks(self.shape[0])):
            out[start:stop] = self._block_sum(index, start, stop)
        self.parts = []
        return out

    def _block_sum(self, index: int, start: int, stop: int) -> torch.Tensor:
        if self.blocks is not None:
            block, self.blocks[index] = self.blocks[index], None  # freed once rounded
            return block
        block = self._zeros(stop - start)
        for g, h in self.parts:
            block += g[:, start:stop].t() @ h
        return block


def linear_logp_function(linear_logp_forward, linear_logp_backward, module: str):
    """`_LinearLogp` of the backend `module`, from its `linear_logp_forward` / `linear_logp_backward`."""

    class _LinearLogp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, deferred):
            ctx.save_for_backward(hidden, weight, bias, targets)
            ctx.temperature, ctx.ignore_index, ctx.deferred = temperature, ignore_index, deferred
            return linear_logp_forward(hidden, weight, bias, targets, temperature, ignore_index)

        @staticmethod
        def backward(ctx, grad_out):
            hidden, weight, bias, targets = ctx.saved_tensors
            grads = linear_logp_backward(
                grad_out,
                hidden,
                weight,
                bias,
                targets,
                ctx.temperature,
                ctx.ignore_index,
                needs=ctx.needs_input_grad[:3],
                deferred=ctx.deferred,
            )
            grad_hidden, grad_weight, grad_bias = grads
            return (
                grad_hidden if ctx.needs_input_grad[0] else None,
                grad_weight if ctx.needs_input_grad[1] else None,
                grad_bias if ctx.needs_input_grad[2] else None,
                None,
                None,
                None,
                None,
            )

    _LinearLogp.__module__, _LinearLogp.__qualname__ = module, "_LinearLogp"
    return _LinearLogp


def sequence_logp_function(forward, backward, module: str):
    """`_SequenceLogp` of the backend `module`: its forward, the layout-invariant `backward`
    (`sequence_logp_backward` around its chunk and exact GEMM)."""

    class _SequenceLogp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, spans, sink):
            ctx.save_for_backward(hidden, targets)
            ctx.params, ctx.mode = (weight, bias), (temperature, ignore_index, spans, sink)
            return forward(hidden, weight, bias, targets, temperature, ignore_index)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            hidden, targets = ctx.saved_tensors
            weight, bias = ctx.params
            grad_hidden = backward(
                grad_out, hidden, weight, bias, targets, *ctx.mode, ctx.needs_input_grad[:3]
            )
            needs, sink = ctx.needs_input_grad, ctx.mode[3]
            return (
                grad_hidden,
                placeholder_grad(sink, weight, needs[1]),
                placeholder_grad(sink, bias, needs[2]),
                *([None] * 5),
            )

    _SequenceLogp.__module__, _SequenceLogp.__qualname__ = module, "_SequenceLogp"
    return _SequenceLogp


def validate(hidden, weight, targets, bias, ignore_index):
    check_projection("hidden", hidden, weight, bias)
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])} (hidden is {tuple(hidden.shape)})"
        )
    check_index_range(
        "targets", targets, weight.shape[0], "the vocabulary size", ignore=ignore_index
    )


def linear_logp_op(chunk_logprobs, chunk_rows_for, serving: Serving, module: str, gemm=None):
    """The public `linear_logp` of the backend `module`, from its chunk: `chunk_logprobs(h,
    weight, bias, temperature)` (its own `lm_head` and `log_softmax` kernels on a chunk of
    rows, fp32 logprobs (n, V)) and `chunk_rows_for(V)` (rows per chunk); `gemm` (its
    ExactGemm) serves the layout-invariant mode (None: the mode raises)."""
    forward = partial(chunked_logp_forward, chunk_logprobs, chunk_rows_for)
    backward = partial(chunked_logp_backward, chunk_logprobs, chunk_rows_for)
    function = linear_logp_function(forward, backward, module)
    sequence_function = None
    if gemm is not None:
        sequence_backward = partial(sequence_logp_backward, chunk_logprobs, chunk_rows_for, gemm)
        sequence_function = sequence_logp_function(forward, sequence_backward, module)

    def build(guard):
        def linear_logp(
            hidden: torch.Tensor,
            weight: torch.Tensor,
            targets: torch.Tensor,
            bias: torch.Tensor | None = None,
            *,
            temperature: float = 1.0,
            ignore_index: int = -100,
            spans=None,
            sink=None,
            deferred_weight_grad: list | None = None,
        ) -> torch.Tensor:
            """hidden (..., H), weight (V, H), targets (...) -> fp32 logprobs (...), 0 where ignored.

            fp64 inputs give fp64 logprobs (for gradcheck); every other dtype gives fp32.
            spans (a SequenceSpans over hidden's flattened rows) and sink: the layout-invariant
            backward (common/linear_logp_sequences.py).
            `deferred_weight_grad` (a list, for a caller that adds the weight's gradient in
            later: a tied embedding's, `executors/worker/policy/tied_gradient.py`): the backward may
            then give the weight no gradient and append to the list a callable that returns
            it, bit for bit. Not with spans / sink (the sink takes the weight's partials).
            """
            validate(hidden, weight, targets, bias, ignore_index)
            guard("hidden", hidden)
            temperature = check_temperature(temperature)
            h2d = hidden.reshape(-1, hidden.shape[-1])
            flat_targets = targets.reshape(-1).long()
            args = (h2d, weight, bias, flat_targets, temperature, ignore_index)
            if check_sequence_mode("linear_logp", spans, sink, h2d.shape[0]):
                if deferred_weight_grad is not None:
                    raise ValueError(
                        "linear_logp: deferred_weight_grad and spans / sink together: the "
                        "sink takes the weight's per-sequence partials"
                    )
                if sequence_function is None:
                    raise NotImplementedError(
                        f"linear_logp: backend {module} has no layout-invariant backward "
                        "(spans / sink); use the cpp backend"
                    )
                check_targets_covered(spans, flat_targets, ignore_index)
                out = sequence_function.apply(*args, spans, sink)
            else:
                out = function.apply(*args, deferred_weight_grad)
            return out.reshape(targets.shape)

        return linear_logp

    return define_op("linear_logp", module, serving, build)
