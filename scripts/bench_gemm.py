"""Fixed-order cpp GEMM (rl_engine linear / lm_head) vs F.linear, interleaved in one process.

    PYTHONPATH=. python scripts/bench_gemm.py [--repeats 7] [--threads 1 2] [--dtypes fp32 bf16]

For every shape, dtype and thread count: both ops run alternately `repeats`
times (each timing the best-of-`inner` calls), and the ratio is
median(cpp) / median(F.linear); < 1 means the cpp kernel is faster.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from rl_engine.kernels.cpp._extension import current_isa, extension

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
    ext, isa = extension(), current_isa()
    print(f"isa={isa} torch={torch.__version__} repeats={args.repeats}")
    print(f"{'shape':26s} {'dtype':5s} {'thr':>3s} {'cpp ms':>9s} {'F.lin ms':>9s} {'ratio':>6s}")
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
            for threads in args.threads:
                torch.set_num_threads(threads)
                ours, ref = [], []
                ext.gemm(x, w, isa), F.linear(x, w)  # warm-up
                for _ in range(args.repeats):
                    ours.append(_time(lambda: ext.gemm(x, w, isa), inner))
                    ref.append(_time(lambda: F.linear(x, w), inner))
                a, b = statistics.median(ours), statistics.median(ref)
                print(
                    f"{name:26s} {dname:5s} {threads:3d} {a * 1e3:9.3f} {b * 1e3:9.3f} {a / b:6.2f}"
                )


if __name__ == "__main__":
    main()
