"""The launch cases of the GPU compile check: op name -> builder(op, dtype, device, subset).

Each builder returns `[(case, thunk)]`: calling a thunk runs the op's own Python path once
(argument checks, layout, tile planning) on tensors of `device`, and inside
`capture_launches()` its launches are recorded instead of run (aot.py compiles them). A case
is a batch layout the op meets in a run: row counts, a row-offset slice (aligned and off a
16-byte boundary), a 1-row view of a wider buffer, decode / prefill / chunked prefill / packed
attention at cache lengths on both sides of the GPU's KV split. Every case of one op, dtype
and kernel variant must compile to one binary (check a): that is batch independence.

The layout-invariant backward (`spans=`, `sink=`) is compiled too: for every op with
kernels in it, `backward_seq*` cases run one backward pass of the op's autograd path over
packed sequences of several lengths (its weight partials' K), so its GEMM
(`exact_gemm_<operand dtype>`) and rms_norm's grad-x kernel are checked like the forward.

`subset="ci"` keeps a documented subset, at least 2 cases per group (the CI test runs it).
A new op adds its builder to `CASES` (docs/adding-an-op.md).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.product_partial import dense

# The dtypes every op is compiled in (the manifest's names for them).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Qwen2.5-0.5B-like sizes (H 896, 14 query heads, 2 kv heads, D 64, I 4864), smaller expert MLPs.
H, HQ, HKV, D, INTER = 896, 14, 2, 64, 4864
VOCABS = (151936, 50257, 32001)  # 50257, 32001: not divisible by 16
E, TOP_K, MOE_INTER = 64, 8, 256
ROWS = (1, 7, 16, 4096)
CI_ROWS = (1, 7)


def _rows(subset):
    return CI_ROWS if subset == "ci" else ROWS


def _row_cases(make, dt, dev, subset, width):
    """The row layouts every row-wise op is launched with: row counts, a row-offset slice
    (aligned and off a 16-byte boundary), a 1-row view of a wider buffer."""
    cases = [
        (f"rows{m}", lambda m=m: make(torch.empty(m, width, dtype=dt, device=dev)))
        for m in _rows(subset)
    ]

    def offset(start):
        buf = torch.empty(16 * width + 64, dtype=dt, device=dev)
        return make(buf[start : start + 9 * width].view(9, width))

    def wide_view():
        return make(torch.empty(4, width + 64, dtype=dt, device=dev)[:1, :width])

    cases += [("offset_rows", lambda: offset(3 * width)), ("offset_unaligned", lambda: offset(1))]
    cases.append(("row_of_wider_buffer", wide_view))
    if subset == "ci":
        return [
            c
            for c in cases
            if c[0] in ("rows1", "rows7", "row_of_wider_buffer", "offset_unaligned")
        ]
    return cases


def _embedding_cases(op, dt, dev, subset):
    w = torch.empty(VOCABS[0], H, dtype=dt, device=dev)

    def ids(n):
        return torch.randint(0, VOCABS[0], (n,), device=dev)

    cases = [(f"tokens{n}", lambda n=n: op(ids(n), w)) for n in _rows(subset)]
    cases.append(("ids_2d_slice", lambda: op(ids(64).view(8, 8)[:, 1:5], w)))
    return cases


def _linear_cases(op, dt, dev, subset):
    w = torch.empty(1152, H, dtype=dt, device=dev)
    b = torch.empty(1152, dtype=dt, device=dev)
    cases = _row_cases(lambda x: op(x, w), dt, dev, subset, H)
    return cases + [
        (f"{c}_bias", f) for c, f in _row_cases(lambda x: op(x, w, b), dt, dev, subset, H)
    ]


def _lm_head_cases(op, dt, dev, subset):
    cases = []
    for vocab in VOCABS if subset != "ci" else VOCABS[:2]:
        w = torch.empty(vocab, H, dtype=dt, device=dev)
        cases += [
            (f"V{vocab}_{c}", f) for c, f in _row_cases(lambda x, w=w: op(x, w), dt, dev, subset, H)
        ]
    return cases


def _rms_norm_cases(op, dt, dev, subset):
    cases = []
    for width in (H, 4096) if subset != "ci" else (H,):  # the chunk width follows H
        w = torch.empty(width, dtype=dt, device=dev)
        rows = _row_cases(lambda x, w=w: op(x, w, 1e-6), dt, dev, subset, width)
        cases += [(f"H{width}_{c}", f) for c, f in rows]
    return cases


def _elementwise_cases(op, dt, dev, subset):
    return _row_cases(op, dt, dev, subset, INTER)


def _log_softmax_cases(op, dt, dev, subset):
    cases = []
    for vocab in VOCABS if subset != "ci" else VOCABS[:2]:
        for c, f in _row_cases(lambda x: op(x, 0.7), dt, dev, subset, vocab):
            cases.append((f"V{vocab}_{c}", f))
    return cases


def _linear_logp_cases(op, dt, dev, subset):
    cases = []
    for vocab in VOCABS[:2]:
        w = torch.empty(vocab, H, dtype=dt, device=dev)
        for n in _rows(subset) + ((300,) if subset != "ci" else ()):  # 300: several chunks

            def run(n=n, w=w, vocab=vocab):
                t = torch.randint(0, vocab, (n,), device=dev)
                return op(torch.empty(n, H, dtype=dt, device=dev), w, t, temperature=0.7)

            cases.append((f"V{vocab}_tokens{n}", run))
    return cases


def _moe_router_cases(op, dt, dev, subset):
    w = torch.empty(E, H, dtype=dt, device=dev)
    cases = []
    for renorm in (False, True):
        for n in _rows(subset) + ((33,) if subset != "ci" else ()):
            cases.append(
                (
                    f"tokens{n}{'_renorm' if renorm else ''}",
                    lambda n=n, r=renorm: op(
                        torch.empty(n, H, dtype=dt, device=dev), w, TOP_K, renormalize=r
                    ),
                )
            )
    return cases


def _moe_experts_cases(op, dt, dev, subset):
    gate_up = torch.empty(E, 2 * MOE_INTER, H, dtype=dt, device=dev)
    down = torch.empty(E, H, MOE_INTER, dtype=dt, device=dev)

    def run(n, experts):
        g = torch.Generator().manual_seed(n)
        idx = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(n)]).to(dev)
        weights = torch.empty(n, TOP_K, dtype=dt, device=dev)
        return op(torch.empty(n, H, dtype=dt, device=dev), gate_up, down, idx, weights)

    counts = (1, 7, 64) if subset != "ci" else (1, 7)
    # few experts: each receives many rows; all experts: most receive one or none
    return [(f"tokens{n}_experts{x}", lambda n=n, x=x: run(n, x)) for n in counts for x in (8, E)]


def _attention_cases(op, dt, dev, subset):
    """Decode, prefill and chunked prefill at several cache lengths and slot layouts; packed rows.
    Positions past 1024 (the GPU's KV split) run the combine kernel."""

    head_dim = D

    def qkv(b, t, s=None, cap=None):
        q = torch.empty(b, t, HQ, head_dim, dtype=dt, device=dev).transpose(1, 2)  # (B, Hq, T, D)
        kv = torch.empty(s or b, HKV, cap or t, head_dim, dtype=dt, device=dev)
        return q, kv, torch.empty_like(kv)

    def prefill(lengths):
        t = max(lengths)
        q, k, v = qkv(len(lengths), t)
        pos = torch.full((len(lengths), t), -1, dtype=torch.long, device=dev)
        for i, n in enumerate(lengths):  # left padded
            pos[i, t - n :] = torch.arange(n, device=dev)
        kpos = pos.clone()
        return op(q, k, v, q_positions=pos, k_positions=kpos)

    def prefill_aligned(t, b=2):
        q, k, v = qkv(b, t)
        pos = torch.arange(t, device=dev).expand(b, t).contiguous()
        return op(q, k, v, q_positions=pos)

    def decode(cache_lengths, cap):
        b = len(cache_lengths)
        q, k, v = qkv(b, 1, s=b + 2, cap=cap)
        pos = torch.tensor([[n] for n in cache_lengths], device=dev)
        kv_index = torch.arange(b, device=dev).flip(0) + 1
        return op(q, k, v, q_positions=pos, kv_index=kv_index)

    def decode_shuffled_slots(n, cap):
        q, k, v = qkv(2, 1, cap=cap)
        kpos = torch.full((2, cap), -1, dtype=torch.long, device=dev)
        kpos[:, : n + 1] = torch.stack([torch.randperm(n + 1), torch.randperm(n + 1)]).to(dev)
        pos = torch.tensor([[n], [n // 2]], device=dev)
        return op(q, k, v, q_positions=pos, k_positions=kpos)

    def chunked(start, t, cap):
        q, k, v = qkv(1, t, s=3, cap=cap)
        pos = torch.arange(start, start + t, device=dev).view(1, t)
        return op(q, k, v, q_positions=pos, kv_index=torch.tensor([2], device=dev))

    def packed(lengths):
        t = sum(lengths)
        q, k, v = qkv(1, t)
        pos = torch.cat([torch.arange(n) for n in lengths]).view(1, t).to(dev)
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).view(1, t).to(dev)
        return op(
            q,
            k,
            v,
            q_positions=pos,
            k_positions=pos.clone(),
            q_segments=seg,
            k_segments=seg.clone(),
        )

    cases = [
        ("decode_cache17", lambda: decode([17, 3], 128)),
        ("decode_cache1100", lambda: decode([1100, 40], 1152)),
        ("decode_cache3000", lambda: decode([3000, 2999, 5], 3072)),
        ("decode_shuffled_slots1500", lambda: decode_shuffled_slots(1500, 1536)),
        ("prefill_left_padded", lambda: prefill([40, 13])),
        ("prefill_aligned1200", lambda: prefill_aligned(1200)),
        ("chunked_prefill_at1000", lambda: chunked(1000, 100, 1152)),
        ("chunked_prefill_at2048", lambda: chunked(2048, 64, 2176)),
        ("packed_3_sequences", lambda: packed([30, 7, 50])),
        ("packed_long", lambda: packed([1100, 60])),
    ]
    if subset == "ci":
        keep = (
            "decode_cache17",
            "decode_cache1100",
            "decode_cache3000",
            "chunked_prefill_at1000",
            "packed_3_sequences",
        )
        cases = [c for c in cases if c[0] in keep]
    cases = [(f"D{D}_{c}", f) for c, f in cases]

    def at_head_dim(d, f):
        nonlocal head_dim
        head_dim = d
        try:
            return f()
        finally:
            head_dim = D

    # other head dims (another BLOCK_D: another variant): Llama / Qwen3's 128, Gemma's 256
    other = [
        ("decode_cache17", lambda: decode([17, 3], 128)),
        ("decode_cache1100", lambda: decode([1100, 40], 1152)),
        ("chunked_prefill_at2048", lambda: chunked(2048, 64, 2176)),
    ]
    for d in (128, 256) if subset != "ci" else (128,):
        cases += [(f"D{d}_{c}", lambda d=d, f=f: at_head_dim(d, f)) for c, f in other]
    return cases


# ----------------------------------------------------------------------------- backward
# The layout-invariant backward (spans= / sink=): its launches are those of one backward
# pass of the op's own autograd path. Each case is a call's sequence lengths (packed into
# one row, 3 padding rows after each): a weight partial's K is a sequence's length, so
# every length must run the group's one binary (`exact_gemm_*`, `rms_norm_backward_*`).
_SEQUENCES = ((1,), (7, 16), (5, 130, 33), (64, 64, 64, 64))
_CI_SEQUENCES = ((1,), (7, 16))


class _DroppingSink:
    """The sink protocol, discarding: the compile check looks at launches, not values."""

    placeholder_grads = False

    def add(self, param, role, index, partial):
        dense(partial)  # a deferred partial's GEMMs launch when it is evaluated

    def add_rows(self, param, role, index, rows, values):
        pass


def _packed_spans(lengths):
    """(rows, SequenceSpans): the sequences one after another, 3 padding rows after each."""
    from rl_engine.kernels.common.sequence_spans import SequenceSpans

    starts, row = [], 0
    for n in lengths:
        starts.append(row)
        row += n + 3
    return row, SequenceSpans(row, tuple(starts), tuple(lengths), tuple(range(len(lengths))))


def _backward_cases(run, dt, dev, subset, width):
    """[(case, thunk)]: run(x (rows, width) requiring grad, spans, sink) -> the tensor whose
    backward (upstream gradient: empty of its shape) the case runs, with grad enabled."""

    def thunk(lengths):
        rows, spans = _packed_spans(lengths)
        with torch.enable_grad():
            x = torch.empty(rows, width, dtype=dt, device=dev, requires_grad=True)
            out = run(x, spans, _DroppingSink())
            out.backward(torch.empty_like(out))

    sequences = _CI_SEQUENCES if subset == "ci" else _SEQUENCES
    return [("backward_seq" + "_".join(map(str, ls)), lambda ls=ls: thunk(ls)) for ls in sequences]


def _param(*shape, dt, dev):
    return torch.nn.Parameter(torch.empty(*shape, dtype=dt, device=dev))


def _linear_backward_cases(op, dt, dev, subset):
    w, b = _param(1152, H, dt=dt, dev=dev), _param(1152, dt=dt, dev=dev)
    return _backward_cases(lambda x, s, k: op(x, w, b, spans=s, sink=k), dt, dev, subset, H)


def _lm_head_backward_cases(op, dt, dev, subset):
    w = _param(VOCABS[1], H, dt=dt, dev=dev)
    return _backward_cases(lambda x, s, k: op(x, w, spans=s, sink=k), dt, dev, subset, H)


def _linear_logp_backward_cases(op, dt, dev, subset):
    w = _param(VOCABS[1], H, dt=dt, dev=dev)

    def run(x, spans, sink):
        targets = torch.zeros(x.shape[0], dtype=torch.long, device=dev)
        targets[~spans.covered(dev)] = -100  # padding rows: no target
        return op(x, w, targets, temperature=0.7, spans=spans, sink=sink)

    return _backward_cases(run, dt, dev, subset, H)


def _rms_norm_backward_cases(op, dt, dev, subset):
    w = _param(H, dt=dt, dev=dev)
    return _backward_cases(lambda x, s, k: op(x, w, 1e-6, spans=s, sink=k), dt, dev, subset, H)


def _moe_router_backward_cases(op, dt, dev, subset):
    """Through the logits only: the routing's own backward is plain torch (no kernel)."""
    w = _param(E, H, dt=dt, dev=dev)
    return _backward_cases(lambda x, s, k: op(x, w, TOP_K, spans=s, sink=k)[0], dt, dev, subset, H)


def _moe_experts_backward_cases(op, dt, dev, subset):
    gate_up = _param(E, 2 * MOE_INTER, H, dt=dt, dev=dev)
    down = _param(E, H, MOE_INTER, dt=dt, dev=dev)

    def run(x, spans, sink):
        g = torch.Generator().manual_seed(x.shape[0])
        n = x.shape[0]
        idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(n)]).to(dev)
        weights = torch.empty(n, TOP_K, dtype=dt, device=dev, requires_grad=True)
        return op(x, gate_up, down, idx, weights, spans=spans, sink=sink)

    return _backward_cases(run, dt, dev, subset, H)


def _with_backward(forward, backward):
    """An op's forward cases, then its layout-invariant backward's."""
    return lambda *a: forward(*a) + backward(*a)


CASES = {
    "embedding": _embedding_cases,
    "linear": _with_backward(_linear_cases, _linear_backward_cases),
    "lm_head": _with_backward(_lm_head_cases, _lm_head_backward_cases),
    "rms_norm": _with_backward(_rms_norm_cases, _rms_norm_backward_cases),
    "silu": _elementwise_cases,
    "sigmoid": _elementwise_cases,
    "log_softmax": _log_softmax_cases,
    "attention": _attention_cases,
    "linear_logp": _with_backward(_linear_logp_cases, _linear_logp_backward_cases),
    "moe_router": _with_backward(_moe_router_cases, _moe_router_backward_cases),
    "moe_experts": _with_backward(_moe_experts_cases, _moe_experts_backward_cases),
}
