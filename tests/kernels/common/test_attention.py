"""attention on packed rows (q_segments / k_segments): a sequence's bits are its own.

Chain checked, always with torch.equal, on every backend (cpp, native, and
triton under the interpreter): prefill of a sequence alone == the same sequence
inside packed rows (several sequences per row, any segment ids, ids reused in
other rows, garbage in the padding at the end of a row) == the right-padded
layout == packed rows with shuffled key slots (keys not in place) and shuffled
queries == decode of each position against an aligned KV cache == a chunk of a
packed row's queries == 1, 2 or 3 threads. Negative controls: without segments
the same packed row mixes its sequences, and plain SDPA with the block-diagonal
causal mask of a packed row (what transformers builds for it) differs from SDPA
on the padded layout. Gradients: against a plain fp64 reference (tolerance),
deterministic, exact zeros for padding. The shared builder (`attention_op`, common/attention.py)
validates the inputs before the dtype gate and, without a gradient wanted, runs the same
forward outside autograd (the same bits). A case whose dtype a backend refuses on this machine
(native's platform probe: PlatformInvarianceError) skips with the op's reason.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.attention import attention_op
from rl_engine.kernels.native.attention import BLOCK_K, BLOCK_Q, attention_forward
from tests.helpers.invariance import assert_equal_across_threads
from tests.helpers.kernels.attention import (
    served_dtypes,
    skip_if_attention_refused,
    skip_if_case_refused,
)
from tests.helpers.kernels.rowwise import FP32_ONLY
from tests.helpers.triton_marks import TRITON_MARKS, dtypes_keeping

DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = [1, 5, BLOCK_Q + 1, 63, BLOCK_K, BLOCK_K + 2, 2 * BLOCK_K + 3, 16, 33, 2]
SMALL = [1, 17, 150, 2, 33]  # for the Triton interpreter (slow); 150 crosses a KV split
# The Triton interpreter is slow: its full set is slow-marked; test_triton_quick runs always.
TRITON_SLOW = [*TRITON_MARKS, pytest.mark.slow]
BACKENDS = ["cpp", "native", pytest.param("triton", marks=TRITON_SLOW)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(autouse=True)
def _skip_refused_case(request):
    """A case with a `backend` (fixture or parameter) skips where that backend's attention
    refuses the case's dtype here (native's platform probe)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "backend" in callspec.params:
        skip_if_case_refused(request, callspec.params["backend"])


def _op(backend):
    return get_op("attention", "cpu", backend=backend)


def _lengths(backend):
    return SMALL if backend == "triton" else LENGTHS


def _seqs(lengths, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv)) for n in lengths
    ]


def _garbage(shape, dtype, seed, scale=1e4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _alone(attention, seq):
    q, k, v = seq
    return attention(q[None], k[None], v[None], q_positions=torch.arange(q.shape[1])[None])[0]


def _packed(seqs, rows: int, *, seed: int = 1, tail: int = 3):
    """Sequences packed round-robin into `rows` rows (in order), garbage padding after them.

    Returns q, k, v (rows, H, N, D), positions and segments (rows, N) (padding: position
    -1 and a junk segment id), and where each sequence sits (row, slice). Segment ids are
    sparse and reused across rows.
    """
    hq, _, d = seqs[0][0].shape
    hkv, dtype = seqs[0][1].shape[0], seqs[0][0].dtype
    fill = [0] * rows
    where = []
    for i, (sq, _, _) in enumerate(seqs):
        r = i % rows
        where.append((r, slice(fill[r], fill[r] + sq.shape[1])))
        fill[r] += sq.shape[1]
    N = max(fill) + tail
    q = _garbage((rows, hq, N, d), dtype, seed)
    k = _garbage((rows, hkv, N, d), dtype, seed + 1)
    v = _garbage((rows, hkv, N, d), dtype, seed + 2)
    pos = torch.full((rows, N), -1, dtype=torch.long)
    seg = torch.full((rows, N), 5, dtype=torch.long)  # padding: an id that real tokens use too
    for i, ((r, sl), (sq, sk, sv)) in enumerate(zip(where, seqs)):
        q[r, :, sl], k[r, :, sl], v[r, :, sl] = sq, sk, sv
        pos[r, sl] = torch.arange(sq.shape[1])
        seg[r, sl] = 3 * (i // rows) + 5  # ids 5, 8, 11, ... in every row
    return q, k, v, pos, seg, where


def _check_rows(out, where, alone, what):
    for i, (r, sl) in enumerate(where):
        assert torch.equal(out[r][:, sl], alone[i]), f"{what}: sequence {i} differs"


# ----------------------------------------------------------------------------- invariance


CPU_BACKENDS = ("cpp", "native")
CPU_HEADS = ((4, 2), (3, 1), (2, 2))  # (query heads, kv heads)


def _cases(triton_keeps: torch.dtype, *, heads: bool = False) -> list:
    """(backend, dtype), or (backend, heads, dtype), parameters: every CPU backend in both
    dtypes; the Triton interpreter (5-20 s a case) in `triton_keeps` in make test and the other
    dtype in the exhaustive tier (tests/helpers/triton_marks.py: dtypes_keeping)."""
    per_backend = {b: [pytest.param(d) for d in DTYPES] for b in CPU_BACKENDS}
    per_backend["triton"] = dtypes_keeping(triton_keeps)
    cases = []
    for backend, dtypes in per_backend.items():
        slow = TRITON_SLOW if backend == "triton" else []
        for param in dtypes:
            (dtype,), marks = param.values, [*slow, *param.marks]
            name = f"{backend}-{str(dtype).removeprefix('torch.')}"
            if not heads:
                cases.append(pytest.param(backend, dtype, marks=marks, id=name))
                continue
            for hq, hkv in CPU_HEADS[:1] if backend == "triton" else CPU_HEADS:
                cases.append(
                    pytest.param(backend, (hq, hkv), dtype, marks=marks, id=f"{name}-{hq}x{hkv}")
                )
    return cases


@pytest.mark.parametrize(("backend", "heads", "dtype"), _cases(torch.bfloat16, heads=True))
def test_packed_rows_equal_alone_and_padded(dtype, backend, heads):
    attention = _op(backend)
    seqs = _seqs(_lengths(backend), *heads, 24, dtype)
    alone = [_alone(attention, s) for s in seqs]
    for rows in (1, 3):
        q, k, v, pos, seg, where = _packed(seqs, rows, seed=rows)
        out = attention(q, k, v, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg)
        _check_rows(out, where, alone, f"{rows} packed row(s)")
        assert not out.transpose(1, 2)[pos < 0].any(), "padding queries must give exact zeros"
    # the padded layout: one right-padded row per sequence
    n = max(s[0].shape[1] for s in seqs)
    q = torch.stack([F.pad(s[0], (0, 0, 0, n - s[0].shape[1])) for s in seqs])
    k = torch.stack([F.pad(s[1], (0, 0, 0, n - s[1].shape[1])) for s in seqs])
    v = torch.stack([F.pad(s[2], (0, 0, 0, n - s[2].shape[1])) for s in seqs])
    pos = torch.stack(
        [F.pad(torch.arange(s[0].shape[1]), (0, n - s[0].shape[1]), value=-1) for s in seqs]
    )
    padded = attention(q, k, v, q_positions=pos)
    for i, s in enumerate(seqs):
        assert torch.equal(padded[i][:, : s[0].shape[1]], alone[i])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=TRITON_MARKS)])
def test_triton_quick(dtype):
    """Triton (interpreter): two packed rows == each sequence alone, one crossing a KV split."""
    attention = _op("triton")
    seqs = _seqs([1, 17, 150, 6], 4, 2, 16, dtype, seed=6)
    alone = [_alone(attention, s) for s in seqs]
    q, k, v, pos, seg, where = _packed(seqs, 2)
    out = attention(q, k, v, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg)
    _check_rows(out, where, alone, "triton packed rows")
    assert not out.transpose(1, 2)[pos < 0].any()


@pytest.mark.parametrize(("backend", "dtype"), _cases(torch.float32))
def test_slot_order_does_not_matter(dtype, backend):
    """Key slots shuffled (keys no longer in place) and query columns shuffled."""
    attention = _op(backend)
    seqs = _seqs(_lengths(backend), 4, 2, 16, dtype, seed=2)
    alone = [_alone(attention, s) for s in seqs]
    q, k, v, pos, seg, where = _packed(seqs, 2)
    perm = torch.randperm(q.shape[2], generator=torch.Generator().manual_seed(0))
    out = attention(
        q,
        k[:, :, perm],
        v[:, :, perm],
        q_positions=pos,
        k_positions=pos[:, perm],
        q_segments=seg,
        k_segments=seg[:, perm],
    )
    _check_rows(out, where, alone, "shuffled key slots")
    out = attention(
        q[:, :, perm],
        k,
        v,
        q_positions=pos[:, perm],
        k_positions=pos,
        q_segments=seg[:, perm],
        k_segments=seg,
    )
    _check_rows(out[:, :, torch.argsort(perm)], where, alone, "shuffled query columns")


@pytest.mark.parametrize(("backend", "dtype"), _cases(torch.bfloat16))
def test_decode_and_chunks_equal_packed_rows(dtype, backend):
    """Each packed position == its decode step against an aligned cache; a chunk of a packed
    row's queries (some sequences cut in the middle) == the same rows of the full call."""
    attention = _op(backend)
    seqs = _seqs(_lengths(backend), 4, 2, 32, dtype, seed=3)
    q, k, v, pos, seg, where = _packed(seqs, 2)
    full = attention(q, k, v, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg)
    picks = [(i, p) for i, s in enumerate(seqs) for p in {0, s[0].shape[1] - 1}]
    tk = max(s[0].shape[1] for s in seqs) + 4
    qd = torch.stack([seqs[i][0][:, p : p + 1] for i, p in picks])
    kc = _garbage((len(picks), 2, tk, 32), dtype, 7)
    vc = _garbage((len(picks), 2, tk, 32), dtype, 8)
    for b, (i, p) in enumerate(picks):
        kc[b, :, : p + 1], vc[b, :, : p + 1] = seqs[i][1][:, : p + 1], seqs[i][2][:, : p + 1]
    dec = attention(qd, kc, vc, q_positions=torch.tensor(picks)[:, 1:])
    for b, (i, p) in enumerate(picks):
        r, sl = where[i]
        assert torch.equal(dec[b, :, 0], full[r, :, sl.start + p]), f"decode {i} at {p}"
    N = q.shape[2]
    chunks = ((N // 3, N - 1),) if backend == "triton" else ((0, N // 3), (N // 3, N - 1), (7, 8))
    for s, e in chunks:
        out = attention(
            q[:, :, s:e],
            k,
            v,
            q_positions=pos[:, s:e],
            k_positions=pos,
            q_segments=seg[:, s:e],
            k_segments=seg,
        )
        live = (pos[:, s:e] >= 0)[:, None, :, None]
        assert torch.equal(torch.where(live, out, 0), torch.where(live, full[:, :, s:e], 0))


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize("cpu_backend", CPU_BACKENDS)
def test_packed_thread_count_invariance(cpu_backend):
    code = """
    from rl_engine.kernels import get_op
    g = torch.Generator().manual_seed(0)
    result = {}
    attention = get_op("attention", "cpu", backend="BACKEND")
    for dtype in DTYPES_SERVED:
        lengths = [300, 1, 40, 129, 17]
        n = sum(lengths)
        q = torch.randn(1, 9, n, 64, generator=g).to(dtype)
        k = torch.randn(1, 3, n, 64, generator=g).to(dtype)
        v = torch.randn(1, 3, n, 64, generator=g).to(dtype)
        pos = torch.cat([torch.arange(m) for m in lengths])[None]
        seg = torch.cat([torch.full((m,), i) for i, m in enumerate(lengths)])[None]
        result[f"BACKEND-{dtype}"] = attention(
            q, k, v, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg
        )
    """
    served = served_dtypes(cpu_backend, DTYPES)  # a refused dtype is left out, not the backend
    assert_equal_across_threads(
        code.replace("BACKEND", cpu_backend).replace("DTYPES_SERVED", repr(served))
    )


def test_negative_control_segments_matter(backend):
    """Without segments the packed row is one long sequence: later sequences see earlier ones."""
    attention = _op(backend)
    seqs = _seqs([20, 30], 4, 2, 16, torch.float32, seed=4)
    alone = [_alone(attention, s) for s in seqs]
    q, k, v, pos, seg, where = _packed(seqs, 1, tail=0)
    flat = torch.arange(q.shape[2])[None]
    out = attention(q, k, v, q_positions=flat, k_positions=flat)
    assert torch.equal(out[0][:, where[0][1]], alone[0])  # the first one sees only itself
    assert not torch.equal(out[0][:, where[1][1]], alone[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_plain_sdpa_packed_differs_from_padded(dtype):
    """Plain torch attention, packed (block-diagonal causal mask, as transformers builds for
    packed rows), does not give the padded layout's bits: the invariant op is needed."""
    seqs = _seqs([100, 37, 250, 9], 4, 4, 64, dtype, seed=5)
    q, k, v, pos, seg, where = _packed(seqs, 1, tail=0)
    allowed = (seg[0][:, None] == seg[0][None, :]) & (pos[0][None, :] <= pos[0][:, None])
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    n = max(s[0].shape[1] for s in seqs)
    same = []
    for i, s in enumerate(seqs):
        m = s[0].shape[1]
        qp, kp, vp = (F.pad(t, (0, 0, 0, n - m))[None] for t in s)
        padded = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)[0, :, :m]
        same.append(torch.equal(packed[0][:, where[i][1]], padded))
    assert not all(same), "plain SDPA became packing invariant: re-check the negative control"


# ----------------------------------------------------------------------------- gradients


def _reference(seq):
    """fp64 causal attention of one sequence (Hq, L, D), differentiable."""
    q, k, v = seq
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, enable_gqa=True
    )[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_packed_backward_matches_reference_and_is_deterministic(dtype, tol, backend):
    attention = _op(backend)
    seqs = _seqs([5, 1, 70, 130, 17] if backend != "triton" else [5, 1, 40, 17], 4, 2, 16, dtype)
    q, k, v, pos, seg, where = _packed(seqs, 2)
    grad = _garbage(q.shape, dtype, 9, scale=1.0)

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg)
        out.backward(grad)
        return [t.grad for t in leaves]

    g1, g2 = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(g1, g2)), "backward is not deterministic"
    for i, ((r, sl), s) in enumerate(zip(where, seqs)):
        leaves = [t.detach().double().requires_grad_() for t in s]
        _reference(leaves).backward(grad[r][:, sl].double())
        for name, got, want in zip("qkv", g1, leaves):
            assert got.dtype == dtype
            torch.testing.assert_close(
                got[r][:, sl].double(), want.grad, atol=tol, rtol=tol, msg=f"d{name} of {i}"
            )
    for t in g1:  # padding queries and padding key slots get exactly zero
        assert not t.transpose(1, 2)[pos < 0].any()


@pytest.mark.parametrize("cpu_backend", ["native", "cpp"])
def test_packed_gradcheck_fp64(cpu_backend):
    """fp64 runs the native op on every CPU backend (where native's probe accepts fp64)."""
    skip_if_attention_refused(cpu_backend, torch.float64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, -1]])
    seg = torch.tensor([[0, 0, 0, 4, 4, 2, 0]])
    fn = functools.partial(
        _op(cpu_backend), q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg
    )
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


# ----------------------------------------------------------------------------- inputs


def _args(**over):
    pos = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, -1]])
    seg = torch.tensor([[0, 0, 1, 1, 1], [7, 7, 7, 7, 0]])
    args = dict(
        q=torch.randn(2, 4, 5, 8),
        k=torch.randn(2, 2, 5, 8),
        v=torch.randn(2, 2, 5, 8),
        q_positions=pos,
        k_positions=pos,
        q_segments=seg,
        k_segments=seg,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(k_segments=None), "q_segments is given but k_segments is None"),
        (dict(q_segments=None), "k_segments is given but q_segments is None"),
        (dict(k_positions=None), "q_segments / k_segments need k_positions"),
        (dict(kv_index=torch.tensor([0, 1])), "kv_index needs the aligned layout"),
        (dict(q_segments=torch.zeros(2, 5)), "q_segments must have an integer dtype"),
        (dict(k_segments=torch.zeros(2, 4, dtype=torch.long)), "k_segments must have shape [2, 5]"),
        (
            dict(q_segments=torch.tensor([[0, 0, 0, 0, 0], [7, 7, 7, 7, 0]])),
            "q_positions: a sequence has the same position twice",
        ),
    ],
)
@pytest.mark.parametrize("any_backend", BACKENDS)
def test_bad_packed_inputs_raise(over, needle, any_backend):
    args = _args(**over)
    # the opt-in op: its argument checks run on every machine, refused dtype or not
    opted_in = get_op("attention", "cpu", backend=any_backend, allow_non_invariant=True)
    with pytest.raises(ValueError) as err:
        opted_in(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert needle in str(err.value), str(err.value)


def test_only_padding_and_empty(backend):
    attention = _op(backend)
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)
    pos, seg = torch.full((2, 4), -1), torch.zeros(2, 4, dtype=torch.long)
    out = attention(q, k, v, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg)
    assert out.shape == q.shape and not out.any()


def test_the_builder_validates_before_the_dtype_gate_and_skips_autograd_without_gradients():
    attention = attention_op(attention_forward, FP32_ONLY, "tests.kernels.common.test_attention")
    args = _args()
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with torch.no_grad():
        plain = attention(q, k, v, **args)
    tracked = attention(q.clone().requires_grad_(True), k, v, **args)
    assert plain.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())
    half = [t.bfloat16() for t in (q, k, v)]
    with pytest.raises(ValueError, match="q_segments is given but k_segments is None"):
        attention(*half, **{**args, "k_segments": None})
    with pytest.raises(NonInvariantDtypeError, match="op 'attention' of backend 'test'"):
        attention(*half, **args)
