"""`rl-engine bench kernels --case attention`: the cpp attention op vs SDPA, at 1 and 2 threads.

    python scripts/bench_attention_cpp.py [--reps 7] [--threads 2 1] [--dtypes float32 bfloat16]

Prints time(cpp) / time(SDPA) per case, each the median of interleaved runs in one process
(rl_engine.benchmarks.timing.interleaved_ratio), built exactly as `rl-engine bench kernels`
builds its attention cases (kernels.attention_prefill / attention_decode), at more shapes.
"""

from __future__ import annotations

import sys

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.kernels import attention_decode, attention_prefill
from rl_engine.benchmarks.timing import interleaved_ratio, intra_op_threads

CASES = [
    ("prefill 2048 tok, 16/4 heads, d64", lambda: attention_prefill(2048)),
    ("prefill 512 tok, 9/3 heads, d64", lambda: attention_prefill(512, 9, 3)),
    ("decode 8 seq x 512 cache, 16/4", lambda: attention_decode(8, 512)),
    ("decode 32 seq x 256 cache, 9/3", lambda: attention_decode(32, 256, 9, 3)),
]
TINY_CASES = [
    ("prefill 20 tok, 4/2 heads, d16", lambda: attention_prefill(20, 4, 2, 16)),
    ("decode 3 seq x 17 cache, 3/1, d16", lambda: attention_decode(3, 17, 3, 1, 16)),
]


def run(cases, threads, dtypes, reps: int, only: str = "") -> list[dict]:
    """One row per (threads, case, dtype): cpp and SDPA medians in ms."""
    rows = []
    for n_threads in threads:
        for dt_name in dtypes:
            for name, make in cases:
                if only not in name:
                    continue
                torch.manual_seed(0)
                ours, plain = make()(getattr(torch, dt_name))
                with torch.no_grad(), intra_op_threads(n_threads):
                    t_ours, t_plain = interleaved_ratio(ours, plain, reps=reps)
                rows.append(
                    {
                        "threads": n_threads,
                        "case": name,
                        "dtype": dt_name,
                        "cpp_ms": t_ours * 1e3,
                        "sdpa_ms": t_plain * 1e3,
                    }
                )
                print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| threads | case | dtype | cpp ms | SDPA ms | ratio |",
        "|---:|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['threads']} | {r['case']} | {r['dtype']} | {r['cpp_ms']:.2f} | "
        f"{r['sdpa_ms']:.2f} | {r['cpp_ms'] / r['sdpa_ms']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="2 threads only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--only", default="", help="substring of the case names to run")
    args = parser.parse_args(argv)
    threads, reps = (args.threads[:1], 3) if args.quick else (args.threads, args.reps)
    if args.tiny:
        threads, reps = [1], 1
    table = render(run(TINY_CASES if args.tiny else CASES, threads, args.dtypes, reps, args.only))
    print(table)
    return table
