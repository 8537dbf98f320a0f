"""`rl-engine bench kernels --case gemm`: the fixed-order cpp GEMM vs F.linear, interleaved in one process.

    python scripts/bench_gemm.py [--repeats 7] [--threads 1 2] [--dtypes fp32 bf16] [--shapes SUBSTRING ...]

For every shape, dtype and thread count, three calls run alternately `repeats` times (each
timing the best of `inner` calls): the cpp `lm_head` op (the GEMM with its fp32 output, as
the kernel writes it), the cpp `linear` op (output in x's dtype, as the model calls it) and
F.linear. Ratios are median / median(F.linear); < 1 means cpp is faster. The ops come from
`get_op(name, "cpu", backend="cpp")`; the header names their numerics (`kernel_facts`).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import intra_op_threads
from rl_engine.kernels import get_op, kernel_facts

SHAPES = (  # (name, M, K, N)
    ("train 4096x1024->2816", 4096, 1024, 2816),
    ("train 2048x576->1536", 2048, 576, 1536),
    ("decode 8x1024->2816", 8, 1024, 2816),
    ("decode 1x576->1536", 1, 576, 1536),
    ("decode 32x576->1536", 32, 576, 1536),
    ("lm_head 8x576->49152", 8, 576, 49152),
    ("lm_head 1024x576->49152", 1024, 576, 49152),
)
TINY_SHAPES = (("train 24x40->72", 24, 40, 72), ("decode 3x40->72", 3, 40, 72))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ("lm_head", "linear", "F.linear")


def _best_of(fn, inner: int) -> float:
    best = float("inf")
    for _ in range(inner):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def medians(calls: dict, repeats: int, inner: int) -> dict[str, float]:
    """Median seconds of each call over `repeats` alternating rounds (best of `inner` each)."""
    for fn in calls.values():  # warm-up
        fn()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_best_of(fn, inner))
    return {name: statistics.median(t) for name, t in times.items()}


def run(shapes, dtypes, threads, repeats: int) -> list[dict]:
    """One row per (shape, dtype, threads): the medians of the three calls, in ms."""
    lm_head, linear = get_op("lm_head", "cpu", backend="cpp"), get_op("linear", "cpu", "cpp")
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for name, m, k, n in shapes:
            for dname in dtypes:
                x = torch.randn(m, k, generator=g).to(DTYPES[dname])
                w = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPES[dname])
                calls = dict(
                    zip(COLUMNS, (functools.partial(f, x, w) for f in (lm_head, linear, F.linear)))
                )
                inner = max(1, min(50, int(2e9 / (2 * m * n * k))))
                for n_threads in threads:
                    with intra_op_threads(n_threads):
                        t = medians(calls, repeats, inner)
                    rows.append({"shape": name, "dtype": dname, "threads": n_threads, **t})
                    print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| shape | dtype | threads | lm_head ms | linear ms | F.linear ms | lm_head / F | linear / F |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = " | ".join(f"{r[c] * 1e3:.3f}" for c in COLUMNS)
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['threads']} | {ms} | "
            f"{r['lm_head'] / r['F.linear']:.2f}x | {r['linear'] / r['F.linear']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="the decode shapes, 2 repetitions")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=None, help="substrings of shape names")
    args = parser.parse_args(argv)
    shapes, repeats, threads = SHAPES, args.repeats, args.threads
    if args.shapes:
        shapes = [s for s in SHAPES if any(part in s[0] for part in args.shapes)]
    if args.quick:
        shapes, repeats = [s for s in shapes if s[0].startswith("decode")], 2
    if args.tiny:
        shapes, repeats, threads = TINY_SHAPES, 1, [1]
    facts = ", ".join(f"{k}={v}" for k, v in kernel_facts("cpu", "cpp").items())
    table = f"{facts}, torch {torch.__version__}, repeats {repeats}\n\n" + render(
        run(shapes, args.dtypes, threads, repeats)
    )
    print(table)
    return table
