"""The native backend's GEMM (native/_tiles.py): fixed-shape row tiles and fixed K slices.

Chain checked through the native `linear` and `lm_head` ops: a row alone == the
same row inside a batch of 1, 7, 16, 64 or 100 rows, at the first and last row
of a tile, in the second tile and at a random row, permuted, next to garbage ==
all of that with 1 and with 2 intra-op threads; fp32 and bf16; K in {300, 576,
1536, 2500, 4096} (one slice, a slice plus a remainder, several slices). It
holds by construction (every library call has one shape per (K slice, N)) where
the platform probe accepts the dtype, and the test skips with the probe's reason
where it does not. Negative control: plain F.linear breaks the chain on a shape
of the same grid.

The scheme's own pieces (slice bounds, padded tiles, accumulator dtype, empty
input, accuracy against fp64) are checked on `_tiles` directly; they hold on every
CPU, so they do not ask the probe. The probe itself: test_platform_probe.py.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import rl_engine.kernels.native._tiles as tiles
import rl_engine.kernels.native.platform_probe as probe_module
from rl_engine.kernels import get_op
from tests.helpers.invariance import garbage_like, probe_batches, skip_if_refused
from tests.helpers.kernels.native_gemm import N, gemm_problem, with_threads

DTYPES = [torch.float32, torch.bfloat16]
K_SIZES = [300, 576, 1536, 2500, 4096]
BATCHES = [1, 7, 16, 64, 100]
TILE = tiles.TILE_ROWS


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
    pool, w = gemm_problem(k, dtype)
    linear, lm_head = (get_op(name, "cpu", backend="native") for name in ("linear", "lm_head"))
    g = torch.Generator().manual_seed(1)
    # every placement once per thread count, alternating the two ops (the same GEMM)
    alone_1 = with_threads(1, functools.partial(_assert_row_invariant, linear, pool, w, g))
    alone_2 = with_threads(2, functools.partial(_assert_row_invariant, lm_head, pool, w, g))
    probe = pool[7:8]
    assert torch.equal(with_threads(2, lambda: linear(probe, w)[0]), alone_1), "1 vs 2 threads"
    assert torch.equal(with_threads(1, lambda: lm_head(probe, w)[0]), alone_2), "2 vs 1 threads"


def test_negative_control_plain_linear_breaks_the_chain():
    """Plain F.linear is not batch-invariant on this grid (fp32: M = 1 takes a GEMV path).

    bf16 F.linear can be invariant on some CPUs (it is on AVX2-only EPYCs); the
    control then rests on the fp32 shapes of the same grid.
    """
    broken = []
    for dtype in DTYPES:
        for k in K_SIZES:
            pool, w = gemm_problem(k, dtype)
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
    pool, w = gemm_problem(widths[0] * (1100 // widths[0]) + widths[1], dtype)
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


# -- the scheme's pieces, on every CPU -------------------------------------------


def test_slice_bounds_cut_k_from_column_zero_with_the_remainder_last():
    assert tiles.slice_bounds(1100, 512) == [(0, 512), (512, 1024), (1024, 1100)]
    assert tiles.slice_bounds(512, 512) == [(0, 512)]
    assert tiles.slice_bounds(37, 256) == [(0, 37)]


def test_slice_width_and_accumulator_follow_the_dtype():
    assert [tiles.k_slice_for(d) for d in tiles.K_SLICE] == [512, 512, 256, 256]
    assert tiles.accumulator_dtype(torch.float64) == torch.float64
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert tiles.accumulator_dtype(dtype) == torch.float32


def test_padded_tiles_are_whole_zero_padded_tiles_of_a_fresh_buffer():
    x = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    padded = tiles._padded_tiles(x.t().contiguous().t())  # a column-major view of the same values
    assert padded.shape == (2 * TILE, 3) and padded.is_contiguous()
    assert torch.equal(padded[:70], x) and not padded[70:].any()
    assert padded.data_ptr() != x.data_ptr()


def test_empty_input_gives_an_empty_result_in_the_out_dtype():
    out = tiles.tiled_matmul(torch.zeros(0, 5), torch.zeros(3, 5), out_dtype=torch.float64)
    assert out.shape == (0, 3) and out.dtype == torch.float64


@pytest.mark.parametrize(
    "dtype,k,tol",
    [(torch.float32, 1100, 1e-5), (torch.float64, 1100, 1e-12), (torch.bfloat16, 600, 2e-2)],
)
def test_tiled_matmul_is_accurate_against_float64(dtype, k, tol):
    """One slice or several: the result is x @ w^T within the dtype's rounding (tolerance:
    the inputs' own precision; bf16 rounds each slice's product to bf16)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, k, generator=g).to(dtype)
    w = (torch.randn(9, k, generator=g) / k**0.5).to(dtype)
    want = x.double() @ w.double().t()
    got = tiles.tiled_matmul(x, w, out_dtype=tiles.accumulator_dtype(dtype))
    assert got.dtype == tiles.accumulator_dtype(dtype)
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


def test_a_transposed_weight_gives_the_bits_of_its_contiguous_copy():
    """The scheme makes a strided weight contiguous first, so the library sees one layout.
    Negative control: the same values with one element changed give other bits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 40, generator=g)
    wt = torch.randn(40, 7, generator=g)  # w = wt.t() is (7, 40) with stride (1, 7)
    strided = tiles.tiled_matmul(x, wt.t(), out_dtype=torch.float32)
    assert torch.equal(strided, tiles.tiled_matmul(x, wt.t().contiguous(), out_dtype=torch.float32))
    changed = wt.t().contiguous()
    changed[0, 0] += 1
    assert not torch.equal(strided, tiles.tiled_matmul(x, changed, out_dtype=torch.float32))
