"""Attention cases of `rl-engine bench kernels`, cpp vs SDPA interleaved, at 1 and 2 threads.

`python scripts/bench_attention_cpp.py [--reps 7] [--threads 2 1] [--dtypes float32 bfloat16]`
prints time(cpp) / time(SDPA) per case, each the median of interleaved runs in
one process (rl_engine.benchmarks.timing.interleaved_ratio), built exactly as
rl_engine.benchmarks.kernels builds its attention cases.
"""

from __future__ import annotations

import argparse

import torch

from rl_engine.benchmarks.kernels import _attention_decode, _attention_prefill
from rl_engine.benchmarks.timing import interleaved_ratio

CASES = [
    ("prefill 2048 tok, 16/4 heads, d64", lambda: _attention_prefill(2048)),
    ("prefill 512 tok, 9/3 heads, d64", lambda: _attention_prefill(512, 9, 3)),
    ("decode 8 seq x 512 cache, 16/4", lambda: _attention_decode(8, 512)),
    ("decode 32 seq x 256 cache, 9/3", lambda: _attention_decode(32, 256, 9, 3)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--only", default="", help="substring of the case names to run")
    args = ap.parse_args()
    print("| threads | case | dtype | cpp ms | SDPA ms | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dt_name in args.dtypes:
            dt = getattr(torch, dt_name)
            for name, make in CASES:
                if args.only not in name:
                    continue
                torch.manual_seed(0)
                ours, plain = make()(dt)
                with torch.no_grad():
                    t_ours, t_plain = interleaved_ratio(ours, plain, reps=args.reps)
                print(
                    f"| {threads} | {name} | {dt_name} | {t_ours * 1e3:.2f} | "
                    f"{t_plain * 1e3:.2f} | {t_ours / t_plain:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
