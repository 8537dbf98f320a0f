"""`rl-engine bench kernels --case decode-gemm`: one decode step's GEMMs on streamed weights.

    rl-engine bench kernels --case decode-gemm [--threads 1 2] [--dtypes bf16 fp32] [--batches 1 8 32]

SmolLM2-135M's shapes without the model: 30 layers x (q, k, v, o, gate, up, down) and the
LM head (49152 x 576), every layer with its own random weights (~270 MB in bf16), so every
call reads its weight from memory as a decode step does. For each batch (M rows) three
whole-step sums, interleaved over `repeats` rounds (best and median; a 64 MiB buffer is
written between rounds so no weight starts in cache):
- `gemm` packs each block of the weight into its panel inside the call (the cpp `linear` /
  `lm_head` ops);
- `packed` runs on panels packed once (the engine's FastDecoder: cpp/packed_linear.py);
- `pack` packs every weight into existing buffers (what the engine pays per generate call).
GB/s = the weights' bytes over the step's time. The copy probe of `rl-engine bench rollout`
(roofline.py) is the memory's rate for comparison.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.roofline import copy_bandwidth
from rl_engine.benchmarks.timing import intra_op_threads
from rl_engine.kernels import backend_layout, get_op, kernel_facts

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LAYER = (  # (N, K) of q, k, v, o, gate, up, down
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ("gemm", "packed", "pack")


def step_weights(dtype, layers: int = LAYERS, vocab: int = VOCAB) -> list[torch.Tensor]:
    """Every projection weight of `layers` layers, then the LM head's."""
    g = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in LAYER] + [(vocab, HIDDEN)]
    return [(torch.randn(n, k, generator=g) / k**0.5).to(dtype) for n, k in shapes]


def step_calls(weights: list[torch.Tensor], batch: int) -> dict:
    """The three whole-step calls (COLUMNS) at `batch` rows; the last weight is the LM head."""
    packing = backend_layout("cpu", "cpp").weight_packing
    linear, lm_head = get_op("linear", "cpu", "cpp"), get_op("lm_head", "cpu", "cpp")
    g = torch.Generator().manual_seed(1)
    dtype = weights[0].dtype
    xs = {k: torch.randn(batch, k, generator=g).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    packed = [packing.pack(w) for w in weights]
    *layers, head = weights

    def gemm():
        for w in layers:
            linear(xs[w.shape[1]], w)
        lm_head(xs[HIDDEN], head)

    def on_packed():
        for w, p in zip(layers, packed):
            packing.project(xs[w.shape[1]], p)
        packing.project(xs[HIDDEN], packed[-1], None, torch.float32)

    def pack():
        for w, p in zip(weights, packed):
            packing.pack(w, into=p)

    return dict(zip(COLUMNS, (gemm, on_packed, pack)))


def timed(calls: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call over `repeats` interleaved rounds, caches flushed before each."""
    flush = torch.zeros(64 * 2**20, dtype=torch.uint8)
    for fn in calls.values():  # warm-up
        fn()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            flush.add_(1)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def run(dtypes, threads, batches, repeats: int, layers: int, vocab: int, mib: int) -> list[dict]:
    """One row per (dtype, threads, batch); `mib`: the copy probe's tensors."""
    rows = []
    with torch.no_grad():
        for dname in dtypes:
            weights = step_weights(DTYPES[dname], layers, vocab)
            mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
            for n_threads in threads:
                with intra_op_threads(n_threads):
                    copy = copy_bandwidth(mib, repeats=3)
                    for batch in batches:
                        t = timed(step_calls(weights, batch), repeats)
                        row = {"dtype": dname, "threads": n_threads, "batch": batch, "mb": mb}
                        rows.append({**row, "copy": copy, "times": t})
                        print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| dtype | threads | batch | weights MB | gemm ms best / median | packed ms best / median "
        "| pack ms best / median | gemm GB/s | packed GB/s | copy GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["times"]
        ms = " | ".join(
            f"{min(t[c]) * 1e3:.2f} / {statistics.median(t[c]) * 1e3:.2f}" for c in COLUMNS
        )
        rates = " | ".join(f"{r['mb'] / 1e3 / min(t[c]):.1f}" for c in ("gemm", "packed"))
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['batch']} | {r['mb']:.1f} | {ms} | {rates} "
            f"| {r['copy']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="bf16, 1 thread, 3 rounds")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args(argv)
    dtypes, threads, repeats, layers, vocab = args.dtypes, args.threads, args.repeats, LAYERS, VOCAB
    mib = 512
    if args.quick:
        dtypes, threads, repeats = ["bf16"], [1], 3
    if args.tiny:
        dtypes, threads, repeats, layers, vocab, mib = ["bf16"], [1], 1, 1, 1000, 8
    facts = ", ".join(f"{k}={v}" for k, v in kernel_facts("cpu", "cpp").items())
    header = f"{facts}, torch {torch.__version__}, {layers} layers, repeats {repeats}\n\n"
    table = header + render(run(dtypes, threads, args.batches, repeats, layers, vocab, mib))
    print(table)
    return table
