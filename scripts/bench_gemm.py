"""Fixed-order cpp GEMM (rl_engine linear / lm_head) vs F.linear, interleaved in one process.

    PYTHONPATH=. python scripts/bench_gemm.py [--repeats 7] [--threads 1 2] [--dtypes fp32 bf16]

For every shape, dtype and thread count, three calls run alternately `repeats`
times (each timing the best of `inner` calls): the bare kernel (`gemm`, fp32
out), the cpp `linear` op (output in x's dtype, as the model calls it) and
F.linear. Ratios are median / median(F.linear); < 1 means cpp is faster.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp.linear import linear

SHAPES = (  # (name, M, K, N)
    ("train 4096x1024->2816", 4096, 1024, 2816),
    ("train 2048x576->1536", 2048, 576, 1536),
    ("decode 8x1024->2816", 8, 1024, 2816),
    ("decode 1x576->1536", 1, 576, 1536),
    ("decode 32x576->1536", 32, 576, 1536),
    ("lm_head 8x576->49152", 8, 576, 49152),
    ("lm_head 1024x576->49152", 1024, 576, 49152),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time(fn, inner: int) -> float:
    best = float("inf")
    for _ in range(inner):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=None, help="substrings of shape names")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    ext, isa = extension(), current_isa()
    print(f"isa={isa} torch={torch.__version__} repeats={args.repeats}")
    print(
        f"{'shape':26s} {'dtype':5s} {'thr':>3s} {'gemm ms':>9s} {'linear ms':>9s} "
        f"{'F.lin ms':>9s} {'gemm/F':>6s} {'lin/F':>6s}"
    )
    g = torch.Generator().manual_seed(0)
    for name, M, K, N in SHAPES:
        if args.shapes and not any(s in name for s in args.shapes):
            continue
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            x = torch.randn(M, K, generator=g).to(dtype)
            w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
            flops = 2 * M * N * K
            inner = max(1, min(50, int(2e9 / flops)))
            kernel = functools.partial(ext.gemm, x, w, isa)
            ours_op = functools.partial(linear, x, w)
            ref_op = functools.partial(F.linear, x, w)
            for threads in args.threads:
                torch.set_num_threads(threads)
                times = {"kernel": [], "linear": [], "F.linear": []}
                for fn in (kernel, ours_op, ref_op):  # warm-up
                    fn()
                for _ in range(args.repeats):
                    times["kernel"].append(_time(kernel, inner))
                    times["linear"].append(_time(ours_op, inner))
                    times["F.linear"].append(_time(ref_op, inner))
                k, o, r = (statistics.median(times[key]) for key in times)
                print(
                    f"{name:26s} {dname:5s} {threads:3d} {k * 1e3:9.3f} {o * 1e3:9.3f} "
                    f"{r * 1e3:9.3f} {k / r:6.2f} {o / r:6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
