"""The `attention` op, written once: its signature, argument checks, backward and autograd.Function.

Argument checks (`validate`), the compute dtype, the backward, the
autograd.Function scaffolding and the op (`attention_op`). The forward, which
decides the bits, is each backend's own (contract: rl_engine/kernels/native/attention.py,
docs/ops/attention.md). The backward is plain torch, shared by native and triton
(cpp has its own); it works one sequence at a time, so a sequence's gradients
depend on that sequence alone (layout-invariant training needs it).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.op import Serving, define_op
from rl_engine.kernels.common.segments import sequences_of

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.float16)


# ----------------------------------------------------------------------------- validation


def _check_positions(name: str, pos: torch.Tensor, shape: tuple[int, int], device) -> None:
    if not isinstance(pos, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(pos).__name__}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype (int64), got {pos.dtype}")
    if tuple(pos.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(pos.shape)}")
    if pos.device != device:
        raise ValueError(f"{name} is on {pos.device}, but q is on {device}")


def validate(
    q, k, v, q_positions, k_positions, scale, kv_index=None, q_segments=None, k_segments=None
) -> float:
    """Raise ValueError naming the offending tensor; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, H, T, D), got shape {list(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be floating point (fp32/bf16/fp64), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, but q is on {q.device}")
    kv_dtypes = (q.dtype, compute_dtype(q.dtype))  # bf16 -> fp32 keys are exact
    if k.dtype != v.dtype or k.dtype not in kv_dtypes:
        raise ValueError(
            f"q, k, v must share a dtype (or k, v in the compute dtype {kv_dtypes[1]}), "
            f"got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    B, Hq, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got k={list(k.shape)}, v={list(v.shape)}"
        )
    Bk, Hkv, Tk, Dk = k.shape
    if kv_index is not None:
        _check_kv_index(kv_index, B, Bk, k_positions, q.device)
    elif Bk != B:
        raise ValueError(f"k has batch size {Bk}, but q has {B}")
    if Dk != D:
        raise ValueError(f"k has head dim D={Dk}, but q has D={D}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q heads (Hq={Hq}) must be a multiple of k/v heads (Hkv={Hkv})")
    _check_positions("q_positions", q_positions, (B, Tq), q.device)
    if k_positions is not None:
        _check_positions("k_positions", k_positions, (B, Tk), q.device)
    _check_segments(q_segments, k_segments, k_positions, kv_index, (B, Tq), (B, Tk), q.device)
    if scale is None:
        return D**-0.5 if D > 0 else 1.0
    if isinstance(scale, torch.Tensor):
        scale = scale.item()
    return float(scale)


def _check_kv_index(kv_index, B: int, S: int, k_positions, device) -> None:
    if isinstance(kv_index, torch.Tensor) and kv_index.dim() == 2:
        _check_block_table(kv_index, B, S, k_positions, device)
        return
    if not isinstance(kv_index, torch.Tensor) or kv_index.dim() != 1:
        raise ValueError(f"kv_index must be a 1-D integer tensor of shape [{B}]")
    _check_positions("kv_index", kv_index.view(-1, 1), (B, 1), device)
    if k_positions is not None:
        raise ValueError("kv_index needs the aligned layout (k_positions=None)")
    if B and not (0 <= int(kv_index.min()) and int(kv_index.max()) < S):
        raise ValueError(f"kv_index must lie in [0, {S}) (k's batch size)")


def _check_block_table(table, B: int, S: int, k_positions, device) -> None:
    """kv_index (B, n): a paged cache's block table (k, v: (blocks, Hkv, block, D))."""
    if table.shape[0] != B:
        raise ValueError(
            f"kv_index (a block table) must have {B} rows (q's batch), got {table.shape[0]}"
        )
    _check_positions("kv_index", table, tuple(table.shape), device)
    if k_positions is not None:
        raise ValueError("kv_index needs the aligned layout (k_positions=None)")
    if table.numel() and not (0 <= int(table.min()) and int(table.max()) < S):
        raise ValueError(f"kv_index (a block table) must lie in [0, {S}) (k's block count)")


def refuse_block_table(kv_index, backend: str) -> None:
    """A backend whose forward reads no block table raises (never a quiet gather)."""
    if kv_index is not None and kv_index.dim() == 2:
        raise ValueError(
            f"kv_index of shape {list(kv_index.shape)} is a block table (paged keys): the "
            f"{backend} attention reads none; the cpp backend does"
        )


def _check_segments(q_segments, k_segments, k_positions, kv_index, q_shape, k_shape, device):
    """Packed rows: both segment tensors or neither, next to k_positions (no aligned cache)."""
    if q_segments is None and k_segments is None:
        return
    if q_segments is None or k_segments is None:
        given, missing = (
            ("q_segments", "k_segments") if k_segments is None else ("k_segments", "q_segments")
        )
        raise ValueError(
            f"{given} is given but {missing} is None: packed rows need both (the segment of "
            "every query and of every key slot)"
        )
    if kv_index is not None or k_positions is None:
        raise ValueError(
            "q_segments / k_segments need k_positions (packed rows give every key slot its "
            "position) and no kv_index (an aligned KV cache holds one sequence per row)"
        )
    _check_positions("q_segments", q_segments, q_shape, device)
    _check_positions("k_segments", k_segments, k_shape, device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 statistics for fp32/bf16/fp16, fp64 only so that gradcheck can run.
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- backward

# Query rows per backward chunk are chosen so that one chunk's score matrix
# (Hq, rows, Tk) stays around this many elements.
_BWD_CHUNK_ELEMS = 1 << 22


def _aligned_sequence(x, kp, L: int, cdt):
    """One sequence's keys or values by position: (Hkv, L, D), zero where absent.

    kp is None (aligned: slot = position) or that sequence's k_positions.
    """
    if kp is None:
        n = min(L, x.shape[1])
        out = torch.zeros((x.shape[0], L, x.shape[2]), dtype=cdt, device=x.device)
        out[:, :n] = x[:, :n]
        return out
    sel = ((kp >= 0) & (kp < L)).nonzero().squeeze(1)
    out = torch.zeros((x.shape[0], L, x.shape[2]), dtype=cdt, device=x.device)
    out[:, kp[sel]] = x[:, sel].to(cdt)
    return out


def _backward_sequences(q_positions, k_positions, q_segments, k_segments):
    """(row b, query columns, that sequence's k_positions or None) of every sequence.

    Without segments a sequence is a row (its columns holding a query: padding
    queries have exact zero gradients and are left out, so that the chunks, and so
    the sums, are the sequence's own); with them, one (row, segment) pair: its own
    query columns, and the row's k_positions with every slot of another segment
    emptied (-1).
    """
    B = q_positions.shape[0]
    if q_segments is None:
        for b in range(B):
            cols = (q_positions[b] >= 0).nonzero().squeeze(1)
            if cols.numel():
                yield b, cols, None if k_positions is None else k_positions[b].long()
        return
    seqs = sequences_of(q_positions, q_segments, k_positions, k_segments)
    for s, b in enumerate(seqs.row.tolist()):
        cols = (seqs.q_seq[b] == s).nonzero().squeeze(1)
        yield b, cols, torch.where(seqs.k_seq[b] == s, k_positions[b].long(), -1)


def attention_backward(
    grad_out, q, k, v, q_positions, k_positions, scale, q_segments=None, k_segments=None
):
    """Plain masked softmax attention gradients, one sequence and query chunk at a time.

    Deterministic, and a sequence's gradients are its own: every torch call works on
    fresh tensors whose shapes and values come from that sequence alone (its queries,
    its keys put by position, chunks of its own queries), so on a platform whose
    batched GEMM computes a call of a given shape the same way every time they do not
    depend on the other sequences, the padding or the packing (measured on this CPU by
    tests/kernels/test_sequence_backward.py; on a GPU, not checked). Keys are first put
    by position, so a chunk only touches the keys up to its last query (causality).
    Padding queries and key slots no query sees get exact zeros. A sequence is a row,
    or with segments one (row, segment) pair of a packed row.
    Returns (dq, dk, dv) in the compute dtype.
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    cdt = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    for b, cols, kp in _backward_sequences(q_positions, k_positions, q_segments, k_segments):
        L = int(q_positions[b, cols].max()) + 1  # positions any query of the sequence sees
        if L <= 0:
            continue
        kb = _aligned_sequence(k[b], kp, L, cdt)  # (Hkv, L, D)
        vb = _aligned_sequence(v[b], kp, L, cdt)
        dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
        kpos = torch.arange(L, device=q.device)
        chunk = max(1, _BWD_CHUNK_ELEMS // (Hq * L))
        for c0 in range(0, cols.numel(), chunk):
            cc = cols[c0 : c0 + chunk]  # (C,) query columns of this chunk
            qpos = q_positions[b, cc].long()  # (C,)
            n = int(qpos.max()) + 1  # keys this chunk can see
            if n <= 0:
                continue
            C = qpos.numel()
            # group heads stacked as rows: (Hkv, G*C, D); padding queries: zero rows
            live = (qpos >= 0)[None, :, None]
            qc = torch.where(live, q[b][:, cc].to(cdt), 0.0).reshape(Hkv, G * C, D)
            go = torch.where(live, grad_out[b][:, cc].to(cdt), 0.0).reshape(Hkv, G * C, D)
            kc, vc = kb[:, :n], vb[:, :n]
            allowed = (kpos[None, :n] <= qpos[:, None]) & (qpos[:, None] >= 0)
            allowed = allowed.repeat(G, 1)  # (G*C, n)
            s = torch.where(allowed, (qc @ kc.transpose(1, 2)) * scale, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # padding rows
            p = torch.exp(s - m)
            den = p.sum(-1, keepdim=True)
            p = p / torch.where(den > 0, den, torch.ones_like(den))  # (Hkv, G*C, n)
            delta = (go * (p @ vc)).sum(-1, keepdim=True)
            ds = torch.where(allowed, p * (go @ vc.transpose(1, 2) - delta), 0.0) * scale
            dq[b][:, cc] = (ds @ kc).view(Hq, C, D)
            dkb[:, :n] += ds.transpose(1, 2) @ qc
            dvb[:, :n] += p.transpose(1, 2) @ go
        if kp is None:
            n = min(L, Tk)
            dk[b, :, :n], dv[b, :, :n] = dkb[:, :n], dvb[:, :n]
        else:  # back to the caller's slots; empty / unseen slots stay 0
            sel = ((kp >= 0) & (kp < L)).nonzero().squeeze(1)
            dk[b][:, sel], dv[b][:, sel] = dkb[:, kp[sel]], dvb[:, kp[sel]]
    return dq, dk, dv


# ----------------------------------------------------------------------------- autograd


def invariant_attention_function(attention_forward, module: str, backward=attention_backward):
    """`_InvariantAttention` of the backend `module`: its forward
    `attention_forward(q, k, v, q_positions, k_positions, scale, kv_index, q_segments,
    k_segments)` (output in q.dtype); backward `backward(grad_out, q, k, v, q_positions,
    k_positions, scale, q_segments, k_segments)` (default: the shared chunked
    `attention_backward`)."""

    class _InvariantAttention(torch.autograd.Function):
        """kv_index is always None here when gradients are needed (see attention_op)."""

        @staticmethod
        def forward(
            ctx, q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments
        ):
            ctx.save_for_backward(q, k, v, q_positions, k_positions, q_segments, k_segments)
            ctx.scale = scale
            return attention_forward(
                q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments
            )

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            q, k, v, q_positions, k_positions, q_segments, k_segments = ctx.saved_tensors
            if q.numel() == 0 or k.numel() == 0:
                dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            else:
                dq, dk, dv = backward(
                    grad_out, q, k, v, q_positions, k_positions, ctx.scale, q_segments, k_segments
                )
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 6)

    _InvariantAttention.__module__ = module
    _InvariantAttention.__qualname__ = "_InvariantAttention"
    return _InvariantAttention


def attention_op(attention_forward, serving: Serving, module: str, backward=attention_backward):
    """The public `attention` of the backend `module`: its forward `attention_forward(q, k, v,
    q_positions, k_positions, scale, kv_index, q_segments, k_segments)` (output in q.dtype),
    and `backward` (default: the shared chunked `attention_backward`)."""
    function = invariant_attention_function(attention_forward, module, backward)

    def build(guard):
        def attention(
            q,
            k,
            v,
            *,
            q_positions,
            k_positions=None,
            scale=None,
            kv_index=None,
            q_segments=None,
            k_segments=None,
        ) -> torch.Tensor:
            """Batch-invariant causal GQA attention (contract: rl_engine/kernels/native/attention.py,
            docs/ops/attention.md).

            q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D); q_positions: (B, Tq) int;
            k_positions: (B, Tk) int or None (aligned KV-cache layout); kv_index: (B,)
            int or None: row b reads k[kv_index[b]], v[kv_index[b]] of (S, Hkv, Tk, D)
            caches (aligned layout only); q_segments (B, Tq) / k_segments (B, Tk) int or
            None: packed rows, a query attends only to keys of its own segment (with
            k_positions). Returns (B, Hq, Tq, D) in q.dtype, exact zeros for padding queries.
            """
            scale = validate(
                q, k, v, q_positions, k_positions, scale, kv_index, q_segments, k_segments
            )
            guard("q", q)
            args = (q_positions, k_positions, scale)
            if not (
                torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            ):  # no gradient wanted (rollout decode): the same forward without autograd's cost
                return attention_forward(q, k, v, *args, kv_index, q_segments, k_segments)
            if kv_index is not None and kv_index.dim() == 2:
                raise ValueError(
                    "kv_index as a block table (paged keys) is forward-only: no gradient flows "
                    "into a paged KV cache"
                )
            if kv_index is not None:  # the backward works on per-row keys
                k, v, kv_index = k.index_select(0, kv_index), v.index_select(0, kv_index), None
            return function.apply(q, k, v, *args, kv_index, q_segments, k_segments)

        return attention

    return define_op("attention", module, serving, build)
