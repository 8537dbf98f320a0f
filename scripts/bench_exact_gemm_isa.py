"""The layout-invariant backward's GEMM (`exact_gemm`, the cpp kernel) against torch's, per ISA path.

Run once per path: `RL_ENGINE_CPU_ISA=avx2 python scripts/bench_exact_gemm_isa.py` (the path an
AVX2-only CPU takes), then with `avx512` / `avx512_bf16` where the CPU has them. Shapes: a
per-sequence weight partial (M = out features, K = a sequence's ~96 rows) and an input gradient
(K = out features). One thread; CPU seconds of the best of 10 calls.
"""

import os
import time

import torch

from rl_engine.kernels.cpp.linear import exact_gemm

SHAPES = ((1536, 576, 96), (400, 576, 1536))


def best_seconds(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"ISA path: {os.environ.get('RL_ENGINE_CPU_ISA', 'the fastest this CPU has')}")
    print("| dtype | M | N | K | exact_gemm GF/s | torch GF/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for m, n, k in SHAPES:
            a, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            flops = 2 * m * n * k
            exact = flops / best_seconds(lambda a=a, b=b: exact_gemm(a, b)) / 1e9
            plain = flops / best_seconds(lambda a=a, b=b: a @ b.t()) / 1e9
            print(f"| {str(dtype)[6:]} | {m} | {n} | {k} | {exact:.0f} | {plain:.0f} |")


if __name__ == "__main__":
    main()
