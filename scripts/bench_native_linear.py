"""native `linear` / `lm_head` GEMM (fixed-shape row tiles) vs F.linear, optionally vs the one it replaced.

    PYTHONPATH=. python scripts/bench_native_linear.py [--before FILE] [--repeats 5] [--threads 2]
        [--dtypes fp32 bf16] [--shapes SUBSTRING ...]

`--before FILE`: a copy of an earlier rl_engine/kernels/native/_gemm.py (for
example `git show cae7951:rl_engine/kernels/native/_gemm.py > /tmp/gemm_before.py`,
the padded, 1024-sliced GEMM of before issue 15), timed interleaved with the
others in this one process. The shapes are those of `rl-engine bench kernels`
(linear train 4096x1024->2816, decode 8x1024->2816) and the LM-head GEMM of
its linear_logp cases (a decode step of 8 rows, a 1024-row chunk over a
49152 vocabulary). Each case alternates the calls `repeats` times and prints
medians and ratios to F.linear (< 1: faster than F.linear). Both native
columns time the GEMM (`fixed_order_matmul`, the op's whole cost but for its
argument checks and the bias), so they compare like with like.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
import torch.nn.functional as F

from rl_engine.kernels.native._gemm import fixed_order_matmul

SHAPES = (  # (name, op, M, K, N)
    ("linear train 4096x1024->2816", "linear", 4096, 1024, 2816),
    ("linear decode 8x1024->2816", "linear", 8, 1024, 2816),
    ("lm_head decode 8x1024->49152", "lm_head", 8, 1024, 49152),
    ("lm_head chunk 1024x1024->49152", "lm_head", 1024, 1024, 49152),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _load_before(path: str):
    spec = importlib.util.spec_from_file_location("native_gemm_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fixed_order_matmul


def _out_dtype(op: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if op == "linear" else torch.promote_types(dtype, torch.float32)


def _calls(op: str, x, w, before):
    calls = {"native": lambda: fixed_order_matmul(x, w, out_dtype=_out_dtype(op, x.dtype))}
    if before is not None:
        calls["before"] = lambda: before(x, w, out_dtype=_out_dtype(op, x.dtype))
    calls["F.linear"] = lambda: F.linear(x, w).to(_out_dtype(op, x.dtype))
    return calls


def _medians(calls: dict, repeats: int) -> dict[str, float]:
    for fn in calls.values():  # warm-up (and the native probe)
        fn()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="an earlier native/_gemm.py to compare")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=None, help="substrings of case names")
    args = parser.parse_args()
    before = _load_before(args.before) if args.before else None
    torch.set_grad_enabled(False)
    names = ["native"] + (["before"] if before else []) + ["F.linear"]
    print(f"torch {torch.__version__}, repeats {args.repeats}, medians in ms")
    header = ["case", "dtype", "threads", *(f"{n} ms" for n in names)]
    header += [f"{n} / F.linear" for n in names[:-1]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * 3 + "---:|" * (len(header) - 3))
    g = torch.Generator().manual_seed(0)
    for case, op, m, k, n in SHAPES:
        if args.shapes and not any(part in case for part in args.shapes):
            continue
        for dname in args.dtypes:
            x = torch.randn(m, k, generator=g).to(DTYPES[dname])
            w = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPES[dname])
            for threads in args.threads:
                torch.set_num_threads(threads)
                t = _medians(_calls(op, x, w, before), args.repeats)
                cells = [f"{t[name] * 1e3:.2f}" for name in names]
                cells += [f"{t[name] / t['F.linear']:.2f}x" for name in names[:-1]]
                print(f"| {case} | {dname} | {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
