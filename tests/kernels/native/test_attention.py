"""attention: the output row of (sequence, head, position) has the same bits in every layout.

Chain checked, always with torch.equal: prefill of the sequence alone
== right-padded aligned batch == left-padded batch (k_positions) == inside a
bigger batch with garbage in every padding slot == decode of that position
against an aligned KV cache (mixed batches, every sequence at its own position,
garbage past each cache end) == chunked prefill == 1, 2 or 3 threads.
Negative control: F.scaled_dot_product_attention breaks decode == prefill here.
Every test runs on both CPU backends (cpp, the default, and native), whose
numerics differ from each other but hold the same chain. BLOCK_K / BLOCK_Q are
the native tile sizes: the lengths around them are the interesting ones there.
A case whose dtype a backend refuses on this machine (native's platform probe:
PlatformInvarianceError, for native in any dtype, for cpp in fp64 / fp16) skips
with the op's reason; test_refuses_where_the_platform_probe_refuses checks the refusal.
Accuracy and gradients are checked against a plain fp64 reference (tolerance).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import PlatformInvarianceError, get_op
from rl_engine.kernels.native.attention import BLOCK_K, BLOCK_Q
from rl_engine.kernels.native.platform_probe import platform_refusal
from tests.helpers.invariance import assert_equal_across_threads
from tests.helpers.kernels.attention import served_dtypes, skip_if_case_refused

DTYPES = [torch.float32, torch.bfloat16]
HEADS = [(4, 2), (3, 1), (2, 2)]  # (Hq, Hkv)
# around the query tile and the key block, and a few odd lengths
LENGTHS = [1, 5, BLOCK_Q + 1, 63, 64, 65, BLOCK_K, BLOCK_K + 2, 2 * BLOCK_K + 3]
SHORT = [1, 5, 63, 64, 65, 130]


BACKENDS = ["cpp", "native"]


@pytest.fixture(params=BACKENDS)
def attention(request):
    """The backend's op; the test skips where it refuses the test's dtype here (the platform
    probe: native in every dtype, cpp in fp64 / fp16)."""
    skip_if_case_refused(request, request.param)
    return get_op("attention", "cpu", backend=request.param)


@pytest.fixture(params=BACKENDS)
def opted_in_attention(request):
    """The backend's opt-in op: its argument checks run on every machine, refused dtype or not."""
    return get_op("attention", "cpu", backend=request.param, allow_non_invariant=True)


# ----------------------------------------------------------------------------- helpers


def _seqs(lengths, hq, hkv, d, dtype, seed=0):
    """One (q, k, v) per sequence: (Hq, L, D), (Hkv, L, D), (Hkv, L, D)."""
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv)) for n in lengths
    ]


def _garbage(shape, dtype, seed, scale=1e4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _alone(attention, seq):
    """Prefill of one sequence by itself: (Hq, L, D)."""
    q, k, v = seq
    pos = torch.arange(q.shape[1])[None]
    return attention(q[None], k[None], v[None], q_positions=pos)[0]


def _padded_batch(seqs, total, *, left, seed=1, scale=1e4):
    """Batch padded to `total` slots with garbage; returns q, k, v, positions (-1 = padding)."""
    hq, _, d = seqs[0][0].shape
    hkv = seqs[0][1].shape[0]
    dtype = seqs[0][0].dtype
    B = len(seqs)
    q = _garbage((B, hq, total, d), dtype, seed, scale)
    k = _garbage((B, hkv, total, d), dtype, seed + 1, scale)
    v = _garbage((B, hkv, total, d), dtype, seed + 2, scale)
    pos = torch.full((B, total), -1, dtype=torch.long)
    for b, (sq, sk, sv) in enumerate(seqs):
        n = sq.shape[1]
        sl = slice(total - n, total) if left else slice(0, n)
        q[b, :, sl], k[b, :, sl], v[b, :, sl] = sq, sk, sv
        pos[b, sl] = torch.arange(n)
    return q, k, v, pos


def _padding_rows(out, pos):
    """Output rows of the padding queries: (N, Hq, D)."""
    return out.transpose(1, 2)[pos < 0]


def _reference(q, k, v, q_positions, k_positions=None, scale=None):
    """Plain masked softmax attention in fp64 (differentiable), zero rows for padding queries."""
    B, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    kpos = torch.arange(tk).expand(B, tk) if k_positions is None else k_positions
    allowed = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= q_positions[:, :, None])  # (B, Tq, Tk)
    live = q_positions >= 0
    kk = k.double().repeat_interleave(hq // hkv, 1)
    vv = v.double().repeat_interleave(hq // hkv, 1)
    # garbage in masked slots must not reach the reference either
    kk = torch.where((kpos >= 0)[:, None, :, None], kk, 0.0)
    vv = torch.where((kpos >= 0)[:, None, :, None], vv, 0.0)
    s = q.double() @ kk.transpose(-1, -2) * (d**-0.5 if scale is None else scale)
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    s = torch.where(live[:, None, :, None], s, 0.0)  # padding rows: any finite row
    out = torch.softmax(s, -1) @ vv
    return torch.where(live[:, None, :, None], out, 0.0)


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)]
)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("d", [16, 64])
def test_matches_fp64_reference(dtype, tol, heads, d, attention):
    seqs = _seqs(SHORT, *heads, d, dtype)
    q, k, v, pos = _padded_batch(seqs, 140, left=True)
    out = attention(q, k, v, q_positions=pos, k_positions=pos)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k, v, pos, pos)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert not _padding_rows(out, pos).any()  # padding queries: exact zeros


def test_custom_scale(attention):
    q, k, v = (t[None] for t in _seqs([37], 4, 2, 16, torch.float32)[0])
    pos = torch.arange(37)[None]
    out = attention(q, k, v, q_positions=pos, scale=0.3)
    torch.testing.assert_close(
        out.double(), _reference(q, k, v, pos, scale=0.3), atol=2e-5, rtol=2e-5
    )


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("d", [16, 64])
def test_padding_and_batch_invariance(dtype, heads, d, attention):
    seqs = _seqs(LENGTHS, *heads, d, dtype)
    alone = [_alone(attention, s) for s in seqs]
    maxlen = max(LENGTHS)
    extra = _seqs([7, 300, 129], *heads, d, dtype, seed=5)  # other sequences sharing the batch
    layouts = {
        "right, aligned": _padded_batch(seqs, maxlen, left=False) + (False,),
        "right, positions": _padded_batch(seqs, maxlen + 3, left=False) + (True,),
        "left": _padded_batch(seqs, maxlen + 11, left=True) + (True,),
        "left, huge garbage": _padded_batch(seqs, maxlen + 1, left=True, seed=9, scale=1e30)
        + (True,),
        "bigger batch": _padded_batch(extra + seqs[::-1], 300, left=False, seed=3) + (False,),
    }
    for name, (q, k, v, pos, with_kpos) in layouts.items():
        out = attention(q, k, v, q_positions=pos, k_positions=pos if with_kpos else None)
        rows = (
            range(len(seqs))
            if name != "bigger batch"
            else range(len(extra) + len(seqs) - 1, len(extra) - 1, -1)
        )
        for i, b in enumerate(rows):
            got = out[b][:, pos[b] >= 0]
            assert torch.equal(got, alone[i]), f"{name}: sequence of length {LENGTHS[i]} differs"
        assert not _padding_rows(out, pos).any(), f"{name}: padding queries must give exact zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_equals_prefill(dtype, heads, attention):
    """Every position of every sequence, decoded in mixed batches against aligned caches.

    All (sequence, position) pairs are shuffled and cut into decode batches of
    varying sizes, so a row meets different neighbours, batch sizes, row
    indices and cache lengths; slots past each row's position hold garbage.
    """
    hq, hkv = heads
    seqs = _seqs(LENGTHS, hq, hkv, 64, dtype)
    alone = [_alone(attention, s) for s in seqs]
    g = torch.Generator().manual_seed(7)
    pairs = [(i, p) for i, n in enumerate(LENGTHS) for p in range(n)]
    pairs = [pairs[j] for j in torch.randperm(len(pairs), generator=g).tolist()]
    sizes, start = [1, 2, 7, 33, 64, 3, 128], 0
    for step in range(len(pairs)):
        batch = pairs[start : start + sizes[step % len(sizes)]]
        if not batch:
            break
        start += len(batch)
        tk = max(p for _, p in batch) + 1 + step % 5  # cache longer than any row needs
        q = torch.stack([seqs[i][0][:, p : p + 1] for i, p in batch])  # (B, Hq, 1, D)
        kc = _garbage((len(batch), hkv, tk, 64), dtype, step, scale=1e30 if step % 2 else 1e4)
        vc = _garbage((len(batch), hkv, tk, 64), dtype, step + 1)
        for b, (i, p) in enumerate(batch):
            kc[b, :, : p + 1], vc[b, :, : p + 1] = seqs[i][1][:, : p + 1], seqs[i][2][:, : p + 1]
        out = attention(q, kc, vc, q_positions=torch.tensor(batch)[:, 1:])
        for b, (i, p) in enumerate(batch):
            assert torch.equal(out[b, :, 0], alone[i][:, p]), f"length {LENGTHS[i]} position {p}"
    assert start == len(pairs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [((8, 1), 72), ((2, 2), 80), ((16, 2), 16), ((6, 3), 40)])
def test_decode_equals_prefill_other_head_dims_and_groups(dtype, heads, d, attention):
    """Head dims not a multiple of 16, G = 1 and 8: decode == prefill row, one mixed batch.

    The prefill of 300 tokens spans many query blocks (keys packed once for all
    of them); a decode batch, a 16-token chunk and a 1-token chunk have one
    block per (sequence, kv head) (keys packed by its task). The decode batch
    mixes cache lengths, reads the cache through kv_index in shuffled order,
    and every slot past a row's position holds inf / nan.
    """
    hq, hkv = heads
    lengths = [1, 17, 40, 300]
    seqs = _seqs(lengths, hq, hkv, d, dtype, seed=11)
    alone = [_alone(attention, s) for s in seqs]
    batch = [(3, 299), (0, 0), (2, 39), (1, 16), (3, 15), (3, 16), (2, 31)]
    tk = 305
    kc = torch.full((len(batch), hkv, tk, d), float("inf")).to(dtype)
    vc = torch.full((len(batch), hkv, tk, d), float("nan")).to(dtype)
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(3))
    for b, (i, p) in enumerate(batch):
        row = int(order[b])
        kc[row, :, : p + 1], vc[row, :, : p + 1] = seqs[i][1][:, : p + 1], seqs[i][2][:, : p + 1]
    q = torch.stack([seqs[i][0][:, p : p + 1] for i, p in batch])
    pos = torch.tensor(batch)[:, 1:]
    out = attention(q, kc, vc, q_positions=pos, kv_index=order)
    for b, (i, p) in enumerate(batch):
        assert torch.equal(out[b, :, 0], alone[i][:, p]), f"decode of length {lengths[i]} at {p}"
    q, k, v = seqs[3]
    for s, e in ((100, 116), (299, 300)):
        out = attention(q[None, :, s:e], k[None], v[None], q_positions=torch.arange(s, e)[None])
        assert torch.equal(out[0], alone[3][:, s:e]), f"chunk [{s}, {e})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_full_prefill(dtype, attention):
    n = 2 * BLOCK_K + 3
    (seq,) = _seqs([n], 4, 2, 64, dtype, seed=4)
    full = _alone(attention, seq)
    q, k, v = seq
    for bounds in ([0, 7, 40, 41, 130, n], [0, BLOCK_Q, BLOCK_K + 5, n], [0, n - 1, n]):
        for s, e in zip(bounds[:-1], bounds[1:]):
            pos = torch.arange(s, e)[None]
            # aligned cache holding exactly keys 0..e-1, then a longer one with garbage
            out = attention(q[None, :, s:e], k[None, :, :e], v[None, :, :e], q_positions=pos)
            assert torch.equal(out[0], full[:, s:e]), f"chunk [{s}, {e})"
            kc = torch.cat([k[:, :e], _garbage((k.shape[0], 50, 64), dtype, e)], 1)[None]
            vc = torch.cat([v[:, :e], _garbage((k.shape[0], 50, 64), dtype, e + 1)], 1)[None]
            out = attention(q[None, :, s:e], kc, vc, q_positions=pos)
            assert torch.equal(out[0], full[:, s:e]), f"chunk [{s}, {e}), longer cache"
            # keys given by position, shuffled, plus empty slots
            perm = torch.randperm(e)
            kpos = torch.cat([perm, torch.full((4,), -1)])[None]
            ks = torch.cat([k[:, perm], _garbage((k.shape[0], 4, 64), dtype, 3)], 1)[None]
            vs = torch.cat([v[:, perm], _garbage((k.shape[0], 4, 64), dtype, 4)], 1)[None]
            out = attention(q[None, :, s:e], ks, vs, q_positions=pos, k_positions=kpos)
            assert torch.equal(out[0], full[:, s:e]), f"chunk [{s}, {e}), shuffled key slots"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_through_kv_index_equals_prefill(dtype, attention):
    """Decode rows reading a larger fp32 slot cache through kv_index (read in place).

    Slots are shuffled and some unused, cache rows past each position hold
    finite garbage, and positions cross block boundaries (groups of different
    block counts); the same rows through a bf16 cache (copied path) too.
    """
    hq, hkv = 4, 2
    lengths = [1, BLOCK_Q + 1, BLOCK_K, BLOCK_K + 2, 2 * BLOCK_K + 3]
    seqs = _seqs(lengths, hq, hkv, 64, dtype, seed=5)
    alone = [_alone(attention, s) for s in seqs]
    cap, slots = 3 * BLOCK_K, 7
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        pick = [(i, int(torch.randint(n, (1,), generator=g))) for i, n in enumerate(lengths)]
        pick = pick[step % 2 :]
        slot_of = torch.randperm(slots, generator=g)[: len(pick)]
        for cache_dtype in (torch.float32, dtype):
            kc = _garbage((slots, hkv, cap, 64), torch.float32, step).to(cache_dtype)
            vc = _garbage((slots, hkv, cap, 64), torch.float32, step + 1).to(cache_dtype)
            for (i, p), s in zip(pick, slot_of.tolist()):
                kc[s, :, : p + 1], vc[s, :, : p + 1] = (
                    seqs[i][1][:, : p + 1],
                    seqs[i][2][:, : p + 1],
                )
            q = torch.stack([seqs[i][0][:, p : p + 1] for i, p in pick])  # (B, Hq, 1, D)
            pos = torch.tensor([[p] for _, p in pick])
            out = attention(q, kc, vc, q_positions=pos, kv_index=slot_of)
            for b, (i, p) in enumerate(pick):
                assert torch.equal(out[b, :, 0], alone[i][:, p]), (
                    f"length {lengths[i]} position {p}"
                )
    # consecutive slots, every block read in place
    kc = torch.zeros((2, hkv, BLOCK_K, 64))
    vc = torch.zeros((2, hkv, BLOCK_K, 64))
    for s, i in enumerate((2, 3)):
        kc[s], vc[s] = (t[:, :BLOCK_K].float() for t in seqs[i][1:])
    q = torch.stack([seqs[i][0][:, p : p + 1] for i, p in ((2, 16), (3, 127))])
    out = attention(q, kc, vc, q_positions=torch.tensor([[16], [127]]), kv_index=torch.arange(2))
    assert torch.equal(out[0, :, 0], alone[2][:, 16]) and torch.equal(
        out[1, :, 0], alone[3][:, 127]
    )


def test_non_finite_garbage_is_ignored(attention):
    """Beyond the contract (finite garbage): inf / nan in padding and past a cache's end."""
    seqs = _seqs([5, 70], 4, 2, 16, torch.float32)
    alone = [_alone(attention, s) for s in seqs]
    q, k, v, pos = _padded_batch(seqs, 80, left=True)
    for t in (q, k, v):
        t.transpose(1, 2)[pos < 0] = float("nan")
    out = attention(q, k, v, q_positions=pos, k_positions=pos)
    assert torch.equal(out[0][:, -5:], alone[0]) and torch.equal(out[1][:, -70:], alone[1])
    assert not _padding_rows(out, pos).any()
    kc = torch.full((1, 2, 90, 16), float("inf"))
    vc = torch.full((1, 2, 90, 16), float("nan"))
    kc[0, :, :70], vc[0, :, :70] = seqs[1][1], seqs[1][2]
    out = attention(seqs[1][0][None, :, 69:70], kc, vc, q_positions=torch.tensor([[69]]))
    assert torch.equal(out[0, :, 0], alone[1][:, 69])


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize("backend", BACKENDS)
def test_thread_count_invariance(backend):
    code = """
    from rl_engine.kernels import get_op
    attention = get_op("attention", "cpu", backend="BACKEND")
    g = torch.Generator().manual_seed(0)
    result = {}
    for dtype in DTYPES_SERVED:
        for hq, hkv, d, n in [(4, 2, 64, 300), (9, 3, 64, 257), (3, 1, 16, 70)]:
            q = torch.randn(2, hq, n, d, generator=g).to(dtype)
            k = torch.randn(2, hkv, n, d, generator=g).to(dtype)
            v = torch.randn(2, hkv, n, d, generator=g).to(dtype)
            pos = torch.arange(n).expand(2, n).contiguous()
            pos[1, n // 2 :] = -1
            result[f"prefill{hq}{dtype}"] = attention(q, k, v, q_positions=pos)
            qd = torch.stack([q[0, :, n - 1 :], q[1, :, n // 2 - 1 : n // 2]])
            p = torch.tensor([[n - 1], [n // 2 - 1]])
            result[f"decode{hq}{dtype}"] = attention(qd, k, v, q_positions=p)
    """
    served = served_dtypes(backend, DTYPES)  # a refused dtype is left out, not the backend
    code = code.replace("BACKEND", backend).replace("DTYPES_SERVED", repr(served))
    out = assert_equal_across_threads(code)
    for key in out:
        if key.startswith("decode"):
            pre = out[key.replace("decode", "prefill")]
            n = pre.shape[2]
            assert torch.equal(out[key][0, :, 0], pre[0, :, n - 1])
            assert torch.equal(out[key][1, :, 0], pre[1, :, n // 2 - 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_sdpa_is_not_invariant(dtype):
    """Plain SDPA: decode rows differ from prefill rows somewhere, so the checks above can fail."""
    (seq,) = _seqs([300], 1, 1, 64, dtype, seed=11)
    q, k, v = (t[None] for t in seq)
    pre = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    same = [
        torch.equal(
            F.scaled_dot_product_attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1])[
                0, :, 0
            ],
            pre[0, :, p],
        )
        for p in range(0, 300, 7)
    ]
    assert not all(same), "SDPA became prefill/decode invariant: re-check the negative control"


# ----------------------------------------------------------------------------- platform


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_refuses_where_the_platform_probe_refuses(dtype):
    """The scores and p @ v are fixed-shape library GEMMs (torch.bmm), resting on the platform
    assumption native's probe measures: a dtype it refuses here raises PlatformInvarianceError
    naming the op, the backend and the dtype (fail closed); a dtype it accepts is served."""
    attention = get_op("attention", "cpu", backend="native")
    q = torch.randn(1, 2, 3, 8).to(dtype)
    call = functools.partial(attention, q, q[:, :1], q[:, :1], q_positions=torch.arange(3)[None])
    reason = platform_refusal(dtype, "cpu")
    if reason is None:
        assert call().dtype == dtype
        return
    with pytest.raises(PlatformInvarianceError) as err:
        call()
    message = str(err.value)
    for named in ("'attention'", "'native'", str(dtype).removeprefix("torch."), reason):
        assert named in message, message


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("dtype", [torch.float64])
def test_gradcheck_fp64(dtype, attention):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 4, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 5, 4, generator=g, dtype=dtype, requires_grad=True)
    left = torch.tensor([[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])
    right = torch.tensor([[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]])
    for qp, kp in ((left, left), (right, None)):
        fn = functools.partial(attention, q_positions=qp, k_positions=kp)
        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("heads", HEADS)
def test_backward_matches_reference_and_is_deterministic(dtype, tol, heads, attention):
    seqs = _seqs([5, 70, 130], *heads, 16, dtype)
    q, k, v, pos = _padded_batch(seqs, 133, left=True)
    grad = _garbage(q.shape, dtype, 5, scale=1.0)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(grad.to(leaves[0].dtype))
        return [t.grad for t in leaves]

    g1 = grads(lambda a, b, c: attention(a, b, c, q_positions=pos, k_positions=pos))
    g2 = grads(lambda a, b, c: attention(a, b, c, q_positions=pos, k_positions=pos))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2)), "backward is not deterministic"
    ref = [t.grad for t in _ref_leaves(q, k, v, pos, grad)]
    for name, got, want in zip("qkv", g1, ref):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=f"d{name}")
    for t in g1:  # padding queries and empty key slots get exactly zero
        assert not t.transpose(1, 2)[pos < 0].any()


def _ref_leaves(q, k, v, pos, grad):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _reference(*leaves, pos, pos).backward(grad.double())
    return leaves


def test_gradient_flows_through_aligned_cache_layout(attention):
    (seq,) = _seqs([20], 4, 2, 16, torch.float32)
    q, k, v = (t[None].clone().requires_grad_() for t in seq)
    kc = torch.cat([k, torch.full((1, 2, 5, 16), 1e4)], 2)
    vc = torch.cat([v, torch.full((1, 2, 5, 16), 1e4)], 2)
    out = attention(q, kc, vc, q_positions=torch.arange(20)[None])
    out.square().sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _reference(*leaves, torch.arange(20)[None]).square().sum().backward()
    for got, want in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- inputs


def _ok(**over):
    args = dict(
        q=torch.randn(2, 4, 3, 8),
        k=torch.randn(2, 2, 5, 8),
        v=torch.randn(2, 2, 5, 8),
        q_positions=torch.arange(3).expand(2, 3),
        k_positions=None,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(q=torch.randn(2, 4, 8)), "q must have rank 4"),
        (dict(k=torch.randn(2, 5, 8)), "k must have rank 4"),
        (dict(v=torch.randn(2, 2, 5, 8, 1)), "v must have rank 4"),
        (dict(k=torch.randn(2, 3, 5, 8), v=torch.randn(2, 3, 5, 8)), "Hq=4"),
        (dict(k=torch.randn(2, 2, 5, 6), v=torch.randn(2, 2, 5, 6)), "D=6"),
        (dict(k=torch.randn(3, 2, 5, 8), v=torch.randn(3, 2, 5, 8)), "k has batch size 3"),
        (dict(v=torch.randn(2, 2, 4, 8)), "v=[2, 2, 4, 8]"),
        (dict(q=torch.ones(2, 4, 3, 8, dtype=torch.int64)), "q must be floating point"),
        (dict(k=torch.randn(2, 2, 5, 8).bfloat16()), "k=torch.bfloat16"),
        (dict(kv_index=torch.tensor([0, 2])), "kv_index must lie in [0, 2)"),
        (dict(kv_index=torch.tensor([0.0, 1.0])), "kv_index must have an integer dtype"),
        (dict(kv_index=torch.tensor([0])), "kv_index must have shape [2, 1]"),
        (dict(q_positions=torch.zeros(2, 3)), "q_positions must have an integer dtype"),
        (
            dict(q_positions=torch.zeros(2, 4, dtype=torch.long)),
            "q_positions must have shape [2, 3]",
        ),
        (
            dict(k_positions=torch.zeros(2, 4, dtype=torch.long)),
            "k_positions must have shape [2, 5]",
        ),
        (dict(k_positions=torch.zeros(2, 5)), "k_positions must have an integer dtype"),
        (
            dict(q_positions=torch.tensor([[0, 1, 1], [0, 1, 2]])),
            "q_positions: a sequence has the same position twice",
        ),
    ],
)
def test_bad_inputs_raise(over, needle, opted_in_attention):
    args = _ok(**over)
    with pytest.raises(ValueError) as err:
        opted_in_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("shape", [(0, 4, 3, 8), (2, 4, 0, 8)])
def test_empty_inputs(shape, attention):
    q = torch.randn(shape, requires_grad=True)
    k = torch.randn(shape[0], 2, 5, 8, requires_grad=True)
    v = torch.randn(shape[0], 2, 5, 8, requires_grad=True)
    out = attention(q, k, v, q_positions=torch.zeros(shape[0], shape[2], dtype=torch.long))
    assert out.shape == shape and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad is not None and not k.grad.any()


def test_all_padding_queries_give_zeros(attention):
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)
    out = attention(q, k, v, q_positions=torch.full((2, 4), -1))
    assert out.shape == q.shape and not out.any()
