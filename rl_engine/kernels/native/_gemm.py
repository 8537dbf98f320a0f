"""Fixed-order GEMM: the one place that decides how a row's dot products are summed.

Plain `F.linear` picks its kernel from the whole call's shape: one row takes a
GEMV path, a few rows take small-matrix kernels, long reductions may be split
across threads, and which of these a call gets differs between CPUs (on an
AMX Xeon a 16-row and a 64-row call summed the same row differently). Each
choice sums a row's products in a different order, so a token's result would
depend on what else is in the batch.

`_tiles.tiled_matmul` gives the library no shape to choose from. For an input
of K columns and a weight of N rows, every library call is

    x_tile (TILE_ROWS, width) @ w_slice (width, N)        one shape per (slice, N)

- rows are cut into tiles of exactly `TILE_ROWS` rows (the last tile is
  zero-padded), copied into one contiguous buffer, so every tile has the same
  shape, strides and alignment whatever the batch size; a row's tile and
  position in it change with the batch, nothing else does;
- K is cut into slices of `k_slice_for(dtype)` columns starting at column 0
  (the last slice is the remainder, a shape fixed by K), and the per-slice
  products are summed in fp32 (fp64 for fp64) in increasing slice order, by
  plain elementwise adds.

So a row's bits follow from the bits of one fixed-shape library call, if that
call computes each output row from that row alone, the same way at every
position in the tile and with any thread count. That is a property of the
library and CPU, not of this code: `platform_probe.py` measures it once per
dtype and process, and the GEMM ops refuse a dtype where it fails (their guard,
`_serving.GEMM`, before `_tiles.tiled_matmul` runs).
"""

from __future__ import annotations

from rl_engine.kernels.native._tiles import K_SLICE, TILE_ROWS, k_slice_for

__all__ = ["K_SLICE", "TILE_ROWS", "k_slice_for"]
