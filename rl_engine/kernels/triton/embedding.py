"""Embedding lookup on the GPU: a gather kernel, so each token's row is its weight row, bit for bit.

Invariant by construction; ids are range-checked by the shared op
(rl_engine/kernels/common/embedding.py) with an error naming the bad values. Backward: torch's dense embedding backward (deterministic: it sorts
the ids, no atomics), which honours padding_idx.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.embedding import embedding_op
from rl_engine.kernels.triton._common import SERVING
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

_BLOCK = 1024


_ARGS = ["ids_ptr", "w_ptr", "out_ptr", "H", "stride_w", "stride_o"]


# nothing specialised: every token count and id layout runs one binary
@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, H, stride_w, stride_o, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + tok).to(tl.int64)
    mask = offs < H
    vals = tl.load(w_ptr + row * stride_w + offs, mask=mask, other=0.0)
    tl.store(out_ptr + tok * stride_o + offs, vals, mask=mask)


def embedding_launch(flat_ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> Launch:
    """The launch that copies weight row flat_ids[t] to out row t (a pure copy: no arithmetic)."""
    H = weight.shape[1]
    return Launch(
        variant="gather",
        kernel=_embedding_kernel,
        grid=(flat_ids.numel(), triton.cdiv(H, _BLOCK)),
        args=(flat_ids, weight, out, H, weight.stride(0), out.stride(0)),
        constexprs=dict(BLOCK=_BLOCK),
        num_warps=4,
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


def embedding_forward(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).contiguous()
    H = weight.shape[1]
    out = torch.empty((flat.numel(), H), dtype=weight.dtype, device=weight.device)
    if flat.numel() and H:
        embedding_launch(flat, weight.contiguous(), out).run()
    return out.reshape(*ids.shape, H)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return embedding_forward(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        grad_w = torch.ops.aten.embedding_dense_backward(
            grad_out.contiguous(), ids, ctx.num_weights, pad, False
        )
        return None, grad_w, None


def apply_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None):
    """ids (...) -> (..., H): the gather kernel, torch's dense backward."""
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _Embedding.apply(ids, weight, padding_idx)


embedding = embedding_op(apply_embedding, SERVING, __name__)
