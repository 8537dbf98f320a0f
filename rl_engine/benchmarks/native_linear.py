"""`rl-engine bench kernels --case native-linear`: the native `linear` / `lm_head` ops vs F.linear.

    python scripts/bench_native_linear.py [--before FILE] [--repeats 5] [--threads 2]
        [--dtypes fp32 bf16] [--shapes SUBSTRING ...]

The native backend (plain torch, fixed-shape row tiles; `get_op(name, "cpu", backend="native")`)
at the shapes of `rl-engine bench kernels` (linear train 4096x1024->2816, decode
8x1024->2816) and the LM-head GEMM of its linear_logp cases (a decode step of 8 rows, a
1024-row chunk over a 49152 vocabulary). Each case alternates the calls `repeats` times and
prints medians and ratios to F.linear (< 1: faster than F.linear).

`--before FILE`: a copy of an earlier native GEMM module (for example `git show
cae7951:rl_engine/kernels/native/_gemm.py > /tmp/gemm_before.py`, the padded, 1024-sliced
GEMM that the fixed-shape tiles replaced): its `fixed_order_matmul(x, w, out_dtype=...)`,
timed interleaved with the others in this one process. The native column times the whole op
(its argument checks included), the `before` column the bare GEMM function.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import intra_op_threads
from rl_engine.kernels import get_op

SHAPES = (  # (name, op, M, K, N)
    ("linear train 4096x1024->2816", "linear", 4096, 1024, 2816),
    ("linear decode 8x1024->2816", "linear", 8, 1024, 2816),
    ("lm_head decode 8x1024->49152", "lm_head", 8, 1024, 49152),
    ("lm_head chunk 1024x1024->49152", "lm_head", 1024, 1024, 49152),
)
TINY_SHAPES = (
    ("linear train 24x40->72", "linear", 24, 40, 72),
    ("lm_head decode 3x40->300", "lm_head", 3, 40, 300),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_before(path: str):
    """`fixed_order_matmul` of an earlier native GEMM module, loaded from its file."""
    spec = importlib.util.spec_from_file_location("native_gemm_before", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--before {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fixed_order_matmul


def _out_dtype(op: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if op == "linear" else torch.promote_types(dtype, torch.float32)


def _calls(op: str, x, w, before):
    native = get_op(op, "cpu", backend="native")
    calls = {"native": lambda: native(x, w)}
    if before is not None:
        calls["before"] = lambda: before(x, w, out_dtype=_out_dtype(op, x.dtype))
    calls["F.linear"] = lambda: F.linear(x, w).to(_out_dtype(op, x.dtype))
    return calls


def medians(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call over `repeats` alternating rounds."""
    for fn in calls.values():  # warm-up (and the native backend's platform probe)
        fn()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(shapes, dtypes, threads, repeats: int, before=None) -> list[dict]:
    """One row per (case, dtype, threads): the median of each call, in seconds."""
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for case, op, m, k, n in shapes:
            for dname in dtypes:
                x = torch.randn(m, k, generator=g).to(DTYPES[dname])
                w = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPES[dname])
                for n_threads in threads:
                    with intra_op_threads(n_threads):
                        t = medians(_calls(op, x, w, before), repeats)
                    rows.append({"case": case, "dtype": dname, "threads": n_threads, **t})
                    print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    names = ["native"] + (["before"] if rows and "before" in rows[0] else []) + ["F.linear"]
    header = ["case", "dtype", "threads", *(f"{n} ms" for n in names)]
    header += [f"{n} / F.linear" for n in names[:-1]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for r in rows:
        cells = [f"{r[name] * 1e3:.2f}" for name in names]
        cells += [f"{r[name] / r['F.linear']:.2f}x" for name in names[:-1]]
        lines.append(f"| {r['case']} | {r['dtype']} | {r['threads']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="the decode shapes, 2 repetitions")
    parser.add_argument("--before", default=None, help="an earlier native GEMM module to compare")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=None, help="substrings of case names")
    args = parser.parse_args(argv)
    before = load_before(args.before) if args.before else None
    shapes, repeats, threads = SHAPES, args.repeats, args.threads
    if args.shapes:
        shapes = [s for s in SHAPES if any(part in s[0] for part in args.shapes)]
    if args.quick:
        shapes, repeats = [s for s in shapes if "decode" in s[0]], 2
    if args.tiny:
        shapes, repeats, threads = TINY_SHAPES, 1, [1]
    rows = run(shapes, args.dtypes, threads, repeats, before)
    table = f"torch {torch.__version__}, repeats {repeats}, medians in ms\n\n" + render(rows)
    print(table)
    return table
