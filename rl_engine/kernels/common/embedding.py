"""The `embedding` op, written once: ids (...) and weight (V, H) -> the weight rows, range-checked.

Invariant by construction (a gather: each token's row is its weight row, bit for
bit); the op exists so that every id is range-checked with an error that names
the bad values (torch's own message is an index error deep inside the gather).
The backend supplies `embedding_forward(ids, weight, padding_idx)` (differentiable).

Layout-invariant mode (`spans=`, `sink=` over ids' flattened tokens): the backward sends
each sequence's rows to `sink.add_rows(weight, "embedding", index, rows, values)`:
rows = the sorted unique ids of its tokens (padding_idx left out, whose gradient is zero),
values[j] = +0, then + the upstream gradient row (in fp32; fp64 for fp64) of each token
with id rows[j], in token order (common/sequence_grads.py: `embedding_partials`). The
weight's gradient is None then.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_embedding
from rl_engine.kernels.common.op import Serving, define_op
from rl_engine.kernels.common.sequence_grads import embedding_partials
from rl_engine.kernels.common.sequence_spans import check_sequence_mode, placeholder_grad


def sequence_embedding_function(embedding_forward, module: str) -> type[torch.autograd.Function]:
    """`_SequenceEmbedding` of the backend `module`: its gather, the per-sequence row partials."""

    class _SequenceEmbedding(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight, ids, padding_idx, spans, sink):
            ctx.save_for_backward(ids)
            ctx.weight, ctx.mode = weight, (padding_idx, spans, sink)
            with torch.no_grad():
                return embedding_forward(ids, weight, padding_idx)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            (ids,) = ctx.saved_tensors
            padding_idx, spans, sink = ctx.mode
            grad = grad_out.reshape(-1, grad_out.shape[-1])  # (M, H)
            parts = embedding_partials(ids.reshape(-1), grad, spans, padding_idx)
            for index, rows, values in parts:
                sink.add_rows(ctx.weight, "embedding", index, rows, values)
            return (
                placeholder_grad(sink, ctx.weight, ctx.needs_input_grad[0]),
                None,
                None,
                None,
                None,
            )

    _SequenceEmbedding.__module__, _SequenceEmbedding.__qualname__ = module, "_SequenceEmbedding"
    return _SequenceEmbedding


def embedding_op(embedding_forward, serving: Serving, module: str):
    """The public `embedding` of the backend `module`."""
    sequence_function = sequence_embedding_function(embedding_forward, module)

    def build(guard):
        def embedding(
            ids: torch.Tensor,
            weight: torch.Tensor,
            padding_idx: int | None = None,
            *,
            spans=None,
            sink=None,
        ) -> torch.Tensor:
            """ids (...) int, weight (V, H) -> (..., H) in weight.dtype. With spans (over ids'
            flattened tokens) and a sink: the layout-invariant backward (module docstring)."""
            check_embedding(ids, weight)
            guard("weight", weight)
            if check_sequence_mode("embedding", spans, sink, ids.numel()):
                return sequence_function.apply(weight, ids, padding_idx, spans, sink)
            return embedding_forward(ids, weight, padding_idx)

        return embedding

    return define_op("embedding", module, serving, build)


def add_embedding_grad_(
    grad_weight: torch.Tensor,
    ids: torch.Tensor,
    grad_out: torch.Tensor,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """`grad_weight` += the embedding's weight gradient for `ids` (...) and the gradient of its
    output `grad_out` (..., H), in place; returns grad_weight.

    Bit for bit what autograd's sum of the two gives (`grad_weight + embedding_dense_backward`,
    as for a weight tied to an LM head), without the dense V x H gradient: the rows of the ids
    that occur are summed by torch's own `embedding_dense_backward` on a table of those rows
    (each row over its tokens in order, as on the full table), then added once; every other
    row adds +0.
    """
    flat = ids.reshape(-1)
    rows, inverse = torch.unique(flat, return_inverse=True)
    pad = -1  # torch's "no padding row"
    if padding_idx is not None:
        hit = (rows == padding_idx).nonzero()
        pad = int(hit[0, 0]) if hit.numel() else -1
    grad2d = grad_out.reshape(flat.numel(), grad_out.shape[-1])
    sums = torch.ops.aten.embedding_dense_backward(grad2d, inverse, rows.numel(), pad, False)
    grad_weight.add_(0.0)  # the rows no id touches: x + 0 (-0.0 becomes +0.0, as in the sum)
    grad_weight[rows] = grad_weight[rows] + sums
    return grad_weight
