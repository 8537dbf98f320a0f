"""The native backend's GEMM: fixed-shape row tiles, fixed K slices, and its platform probe.

Chain checked through the native `linear` and `lm_head` ops: a row alone == the
same row inside a batch of 1, 7, 16, 64 or 100 rows, at the first and last row
of a tile, in the second tile and at a random row, permuted, next to garbage ==
all of that with 1 and with 2 intra-op threads; fp32 and bf16; K in {300, 576,
1536, 2500, 4096} (one slice, a slice plus a remainder, several slices). It
holds by construction (every library call has one shape per (K slice, N)) where
the platform probe accepts the dtype, and the test skips with the probe's reason
where it does not. Negative control: plain F.linear breaks the chain on a shape
of the same grid.

The probe's refusal path cannot be reached on a real CPU that passes it, so it
is checked with fakes: library schemes that break one assumption each, and a
measurement that reports a thread-count mismatch.
"""

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import PlatformInvarianceError, get_op, kernel_facts
from tests.helpers.invariance import garbage_like, probe_batches, skip_if_refused

probe_module = importlib.import_module("rl_engine.kernels.native.platform_probe")

DTYPES = [torch.float32, torch.bfloat16]
K_SIZES = [300, 576, 1536, 2500, 4096]
BATCHES = [1, 7, 16, 64, 100]
N = 300
TILE = 64


def _problem(k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(256, k, generator=g).to(dtype)
    w = (torch.randn(N, k, generator=g) / k**0.5).to(dtype)
    return pool, w


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _positions(size):
    """A tile's first and last row, the second tile's first row, the batch's last row."""
    return sorted({0, min(TILE - 1, size - 1), size - 1} | ({TILE} if size > TILE else set()))


def _assert_row_invariant(op, pool, w, g):
    probe = pool[7]
    alone = op(probe[None], w)[0]
    for size in BATCHES:
        batch = pool[torch.randint(0, pool.shape[0], (size,), generator=g)].clone()
        for row in _positions(size):
            placed = batch.clone()
            placed[row] = probe
            assert torch.equal(op(placed, w)[row], alone), f"batch of {size}, row {row}"
        (placed, row), where = (
            next(probe_batches(probe, pool, [size], seed=size)),
            f"batch of {size}",
        )
        noisy = garbage_like(placed)
        noisy[row] = probe
        assert torch.equal(op(noisy, w)[row], alone), f"{where}, garbage around row {row}"
        perm = torch.randperm(size, generator=g)
        moved = (perm == row).nonzero().item()
        assert torch.equal(op(placed[perm], w)[moved], alone), f"{where}, permuted to row {moved}"
    return alone


@pytest.mark.parametrize("k", K_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_alone_equals_row_in_any_batch_position_and_thread_count(dtype, k):
    skip_if_refused("native", dtype)
    pool, w = _problem(k, dtype)
    linear, lm_head = (get_op(name, "cpu", backend="native") for name in ("linear", "lm_head"))
    g = torch.Generator().manual_seed(1)
    # every placement once per thread count, alternating the two ops (the same GEMM)
    alone_1 = _with_threads(1, functools.partial(_assert_row_invariant, linear, pool, w, g))
    alone_2 = _with_threads(2, functools.partial(_assert_row_invariant, lm_head, pool, w, g))
    probe = pool[7:8]
    assert torch.equal(_with_threads(2, lambda: linear(probe, w)[0]), alone_1), "1 vs 2 threads"
    assert torch.equal(_with_threads(1, lambda: lm_head(probe, w)[0]), alone_2), "2 vs 1 threads"


def test_negative_control_plain_linear_breaks_the_chain():
    """Plain F.linear is not batch-invariant on this grid (fp32: M = 1 takes a GEMV path).

    bf16 F.linear can be invariant on some CPUs (it is on AVX2-only EPYCs); the
    control then rests on the fp32 shapes of the same grid.
    """
    broken = []
    for dtype in DTYPES:
        for k in K_SIZES:
            pool, w = _problem(k, dtype)
            alone = F.linear(pool[7:8], w)[0]
            for batch, row in probe_batches(pool[7], pool, BATCHES[1:]):
                if not torch.equal(F.linear(batch, w)[row], alone):
                    broken.append((dtype, k, batch.shape[0]))
    assert broken, "plain F.linear was invariant on the whole grid: the tests above prove nothing"
    assert any(dtype == torch.float32 for dtype, _, _ in broken)


@pytest.mark.parametrize("dtype,widths", [(torch.float32, (512, 76)), (torch.bfloat16, (256, 76))])
def test_every_library_call_has_one_shape_per_slice(monkeypatch, dtype, widths):
    """K = 1100: full slices then a 76-column remainder; every call is (64 x width) @ (width x N)."""
    skip_if_refused("native", dtype)
    probe_module.probe(dtype, "cpu")  # measured (or cached) first: the spy must not see it
    pool, w = _problem(widths[0] * (1100 // widths[0]) + widths[1], dtype)
    calls = set()
    real_mm = torch.mm

    def spy(a, b, *, out=None):
        calls.add((tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), tuple(out.shape)))
        return real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", spy)
    linear = get_op("linear", "cpu", backend="native")
    k = pool.shape[1]
    for size in (1, 7, 63, 64, 65, 100, 256):
        linear(pool[:size], w)
        linear(pool[size % 5 :: 2][: max(1, size // 2)], w)  # a strided view of x
    monkeypatch.undo()
    assert calls == {((TILE, width), (k, 1), (width, N), (1, k), (TILE, N)) for width in widths}, (
        calls
    )


def _stated_scheme(x, w, out_dtype, width):
    """The scheme as operators.md states it, one tile and one slice at a time."""
    rows, k = x.shape
    padded = torch.cat([x, x.new_zeros(-rows % TILE, k)])
    sliced = k > width
    tiles = []
    for r in range(0, padded.shape[0], TILE):
        acc = None
        for a in range(0, k, width):
            b = min(a + width, k)
            part = torch.mm(padded[r : r + TILE, a:b], w[:, a:b].t())
            part = part.to(torch.float32) if sliced else part
            acc = part if acc is None else acc + part
        tiles.append(acc)
    return torch.cat(tiles)[:rows].to(out_dtype)


@pytest.mark.parametrize("dtype,width", [(torch.float32, 512), (torch.bfloat16, 256)])
def test_the_gemm_is_the_stated_tile_and_slice_sum(dtype, width):
    """64-row zero-padded tiles; K slices from column 0; products summed in fp32, slice 0 first."""
    skip_if_refused("native", dtype)
    g = torch.Generator().manual_seed(2)
    for m, k, n in [(1, 300, 77), (70, 1100, 300), (130, width, 33), (64, 2500, 5)]:
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        for name, out_dtype in (("linear", dtype), ("lm_head", torch.float32)):
            got = get_op(name, "cpu", backend="native")(x, w)
            assert torch.equal(got, _stated_scheme(x, w, out_dtype, width)), (name, m, k, n)


# -- the platform probe ---------------------------------------------------------


@pytest.fixture
def fresh_probe():
    """The probe's per-process cache emptied before and after (the fakes' verdicts must not stay)."""
    probe_module.probe.cache_clear()
    yield probe_module
    probe_module.probe.cache_clear()


_tiled = probe_module.tiled_matmul  # the real scheme: row-wise where the probe accepts


def _other_order(x, w):
    # A correctly rounded product: differs from the library's fp32 sums in most rows.
    return (x.double() @ w.double().t()).to(torch.float32)


def _odd_rows_differ(x, w, *, out_dtype):
    out = _tiled(x, w, out_dtype=torch.float32)
    out[1::2] = _other_order(x[1::2], w)
    return out.to(out_dtype)


def _large_rows_change_their_tile(x, w, *, out_dtype):
    out = _tiled(x, w, out_dtype=torch.float32)
    for start in range(0, x.shape[0], TILE):
        if x[start : start + TILE].abs().max() > 100:
            out[start : start + TILE] = _other_order(x[start : start + TILE], w)
    return out.to(out_dtype)


def _one_thread_differs(x, w, *, out_dtype):
    if torch.get_num_threads() == 1:
        return _other_order(x, w).to(out_dtype)
    return _tiled(x, w, out_dtype=out_dtype)


def _odd_weight_address_differs(x, w, *, out_dtype):
    if w.storage_offset() % 2:
        return _other_order(x, w).to(out_dtype)
    return _tiled(x, w, out_dtype=out_dtype)


@pytest.mark.parametrize(
    "scheme,assumption",
    [
        (_odd_rows_differ, "row position"),
        (_large_rows_change_their_tile, "other rows"),
        (_one_thread_differs, "thread count"),
        (_odd_weight_address_differs, "weight address"),
    ],
)
def test_probe_names_the_assumption_a_scheme_breaks(monkeypatch, fresh_probe, scheme, assumption):
    """Each fake breaks one assumption on top of the real scheme; the probe names that one only."""
    skip_if_refused("native", torch.float32)  # the real scheme must pass for the base to be sound
    monkeypatch.setattr(fresh_probe, "tiled_matmul", scheme)
    result = fresh_probe.probe(torch.float32, "cpu")
    assert [name for name, _ in result.failures] == [assumption], result.failures
    assert result.outcome == f"refused: {assumption}"


def test_refusal_is_one_clear_error_for_that_dtype_only(monkeypatch, fresh_probe):
    """A measurement that reports a thread-count mismatch for fp32 refuses fp32; bf16 keeps working."""
    skip_if_refused("native", torch.bfloat16)
    real = fresh_probe._measure
    measured = []

    def mismatching_threads(x, w, threads=None):
        measured.append(x.dtype)
        out = real(x, w, threads)
        if x.dtype == torch.float32 and threads is not None:
            out = out.clone()
            out[5] = torch.nextafter(out[5], torch.full_like(out[5], float("inf")))
        return out

    monkeypatch.setattr(fresh_probe, "_measure", mismatching_threads)
    pool, w = _problem(600, torch.float32)
    targets = torch.zeros(3, dtype=torch.long)
    for name, args in [
        ("linear", (pool[:3], w)),
        ("lm_head", (pool[:3], w)),
        ("linear_logp", (pool[:3], w, targets)),
        ("linear", (pool[:3], w)),  # again: the same error, from the cached verdict
    ]:
        with pytest.raises(PlatformInvarianceError) as err:
            get_op(name, "cpu", backend="native")(*args)
        message = str(err.value)
        assert "float32" in message and "intra-op thread count" in message, message
        assert "1 of 64 rows differ" in message and "backend 'cpp'" in message, message
    assert isinstance(err.value, RuntimeError)
    fp32_measurements = measured.count(torch.float32)
    assert fp32_measurements > 0

    bf16_pool, bf16_w = pool.bfloat16(), w.bfloat16()
    alone = get_op("linear", "cpu", backend="native")(bf16_pool[:1], bf16_w)
    assert torch.equal(get_op("linear", "cpu", backend="native")(bf16_pool, bf16_w)[:1], alone)
    assert measured.count(torch.float32) == fp32_measurements, "fp32 was measured twice"
    assert torch.equal(get_op("linear", "cpu")(pool[:3], w), get_op("linear", "cpu")(pool, w)[:3])

    facts = kernel_facts("cpu", backend="native")
    assert facts["native_fp32_platform"] == "refused: thread count"
    assert facts["native_bf16_platform"] == "invariant"


@pytest.mark.parametrize(
    "dtype,advice",
    [
        (torch.float32, "Use backend 'cpp' for float32"),
        (torch.bfloat16, "Use backend 'cpp' for bfloat16"),
        (
            torch.float64,
            "No backend here is row-invariant for float64",
        ),  # cpp's fp64 is a library GEMM
    ],
)
def test_refusal_advice_names_a_backend_only_where_one_holds_the_contract(dtype, advice):
    result = probe_module.ProbeResult(dtype, "cpu", (("row position", "rows reversed: 3 of 64"),))
    message = probe_module.refusal_message(result)
    assert advice in message and "rows reversed: 3 of 64" in message, message
    assert "position in the tile" in message, message


@pytest.mark.parametrize("threads", [1, 2])
def test_probe_restores_the_thread_count(fresh_probe, threads):
    def run():
        fresh_probe.probe(torch.float32, "cpu")
        return torch.get_num_threads()

    assert _with_threads(threads, run) == threads


def test_kernel_facts_record_tile_slices_and_probe_outcome():
    facts = kernel_facts("cpu", backend="native")
    assert facts["backend"] == "native"
    assert (facts["native_tile_rows"], facts["native_fp32_k_slice"]) == ("64", "512")
    assert facts["native_bf16_k_slice"] == "256"
    for dtype in ("fp32", "bf16"):
        outcome = facts[f"native_{dtype}_platform"]
        assert outcome == "invariant" or outcome.startswith("refused: "), outcome
    assert kernel_facts("cpu", backend="native") == facts
