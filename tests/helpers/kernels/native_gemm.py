"""What the native GEMM's tests share (native/test_tiles.py, native/test_platform_probe.py): a
pool of rows and a weight, and a call at a given intra-op thread count."""

from __future__ import annotations

import torch

N = 300  # output features: a full 256-wide tile and a narrow remainder


def gemm_problem(k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(a pool of 256 rows of width k, an (N, k) weight scaled like a layer's), in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(256, k, generator=g).to(dtype)
    w = (torch.randn(N, k, generator=g) / k**0.5).to(dtype)
    return pool, w


def with_threads(threads: int, fn):
    """`fn()` with torch's intra-op thread count set to `threads`, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)
