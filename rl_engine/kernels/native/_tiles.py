"""Fixed-shape row tiles and fixed K slices: the arithmetic of native's GEMM.

See `_gemm.py` for why. This module is the scheme alone (no platform check), so
that the platform probe can measure exactly what the GEMM ops run.
"""

from __future__ import annotations

import torch

# Rows per library call. docs/platform-facts.md: on the AMX Xeon, tiles of 16 and 64
# rows were row-, position- and permutation-invariant, and tiles of 64-256 rows
# (with K slices <= 512) also thread-count invariant; 64 is in both sets.
# Speed: 16-row tiles cost 2.5x more than 64 at training shapes there.
TILE_ROWS = 64

# Reduction slice width per dtype (columns of K per library call). 512 / 256 are
# within the <= 512 measured thread-invariant on the AMX Xeon; 16-bit slices stay
# at 256, where the Xeon's bf16 GEMM was M-invariant even without fixed tiles.
K_SLICE = {
    torch.float32: 512,
    torch.float64: 512,
    torch.bfloat16: 256,
    torch.float16: 256,
}


def k_slice_for(dtype: torch.dtype) -> int:
    """Reduction slice width used for `dtype` (the same on every CPU)."""
    return K_SLICE[dtype]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tiled_matmul(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """The tile scheme itself, without the platform check (the probe measures this)."""
    rows, n = x.shape[0], weight.shape[0]
    if rows == 0:
        return x.new_empty(0, n, dtype=out_dtype)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    tiles = _padded_tiles(x)  # (tiles * TILE_ROWS, K), contiguous
    bounds = slice_bounds(x.shape[1], k_slice_for(x.dtype))
    if len(bounds) == 1:
        out = _tile_products(tiles, weight)  # (tiles * TILE_ROWS, N) in x.dtype
    else:
        out = _sliced_sum(tiles, weight, bounds)  # fp32 (fp64)
    return out[:rows].to(out_dtype)


def slice_bounds(k: int, width: int) -> list[tuple[int, int]]:
    """[(start, stop)] of the K slices: `width` columns each from column 0, the rest last."""
    return [(start, min(start + width, k)) for start in range(0, k, width)]


def _padded_tiles(x: torch.Tensor) -> torch.Tensor:
    # A fresh buffer: every tile starts a multiple of TILE_ROWS * K elements (so of
    # 64 bytes) from an allocator-aligned base, with row stride K, whatever x was.
    rows, k = x.shape
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    tiles = x.new_empty(padded, k)
    tiles[:rows] = x
    tiles[rows:] = 0
    return tiles


def _tile_products(tiles: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """tiles @ w^T, one library call per TILE_ROWS rows, each writing its own rows of the result."""
    out = tiles.new_empty(tiles.shape[0], w.shape[0])
    wt = w.t()  # (width, N) view
    for row in range(0, tiles.shape[0], TILE_ROWS):
        torch.mm(tiles[row : row + TILE_ROWS], wt, out=out[row : row + TILE_ROWS])
    return out


def _sliced_sum(tiles: torch.Tensor, weight: torch.Tensor, bounds) -> torch.Tensor:
    """Sum over K slices, slice 0 first, of the per-slice tile products, in fp32 (fp64)."""
    acc = tiles.new_empty(tiles.shape[0], weight.shape[0], dtype=accumulator_dtype(tiles.dtype))
    part = tiles.new_empty(TILE_ROWS, weight.shape[0])  # one fixed output buffer, x.dtype
    # Slice-outer, tile-inner: one weight slice stays in cache across the tiles, and
    # each tile's product is added while it is in cache. The loop order cannot
    # change a bit: every output is the same sum, slice 0 first.
    for i, (start, stop) in enumerate(bounds):
        wt = weight[:, start:stop].t()  # (width, N) view
        for row in range(0, tiles.shape[0], TILE_ROWS):
            x_tile, dst = tiles[row : row + TILE_ROWS, start:stop], acc[row : row + TILE_ROWS]
            if i == 0 and acc.dtype == tiles.dtype:
                torch.mm(x_tile, wt, out=dst)
                continue
            torch.mm(x_tile, wt, out=part)  # bf16 / fp16: the product is rounded here
            if i == 0:
                dst.copy_(part)
            else:
                dst.add_(part)
    return acc
