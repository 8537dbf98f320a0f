"""`rl-engine bench kernels --device cuda`: the Triton backend vs cuBLAS / SDPA / materialised logits.

One run, interleaved CUDA-event timings (median of `reps`), bf16, on the
GPU target shapes:
- matmul 8192 x 4096 -> 4096 (training) and 1 / 8 / 64 rows (decode): invariant
  linear vs F.linear (cuBLAS); target >= 0.8x cuBLAS throughput (training),
  >= 0.5x (decode);
- attention prefill 4096 tokens and decode (32 sequences x 4096 cache, read
  in place through kv_index) vs F.scaled_dot_product_attention (flash for
  prefill); targets <= 1.5x and <= 2x the time;
- per-token logprobs at 4096 tokens x 128256 vocab: fused linear_logp vs
  materialised F.linear + log_softmax + gather (time and peak extra memory);
- a train step (forward + backward of token_logprobs, 8 x 512 tokens) of a
  randomly initialised Llama, patched vs unpatched; target <= 1.2x.
`--tiny`: every row at a tiny size (`Sizes`), 2 repetitions; its verdicts mean nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl_engine.benchmarks.args import bench_parser
from rl_engine.kernels import get_op

DEV = "cuda"


@dataclass
class Row:
    what: str
    shape: str
    ms_ours: float
    ms_ref: float
    ref: str
    target: str  # e.g. "<= 1.50x"; '' = report only

    @property
    def ratio(self) -> float:
        return self.ms_ours / self.ms_ref

    @property
    def verdict(self) -> str:
        if not self.target:
            return ""
        bound = float(self.target.split()[1].rstrip("x"))
        return "met" if self.ratio <= bound else "MISSED"


@dataclass(frozen=True)
class Sizes:
    """The rows' shapes: matmul width, attention and logprob tokens, vocab, the Llama's step."""

    width: int = 4096
    train_rows: int = 8192
    decode_rows: tuple[int, ...] = (1, 8, 64)
    tokens: int = 4096  # attention prefill, decode cache, logprob tokens
    decode_batch: int = 32
    heads: tuple[int, int, int] = (32, 8, 128)  # query heads, kv heads, head dim
    vocab: int = 128256
    llama: tuple[int, int, int, int, int] = (32000, 2048, 5632, 8, 16)  # V, H, I, layers, heads
    step: tuple[int, int] = (8, 512)  # sequences, tokens each
    reps: int = 10


FULL = Sizes()
TINY = Sizes(
    width=64,
    train_rows=96,
    decode_rows=(1, 8),
    tokens=80,
    decode_batch=3,
    heads=(4, 2, 32),
    vocab=500,
    llama=(500, 64, 128, 1, 4),
    step=(2, 16),
    reps=2,
)


def cuda_ms(ours: Callable, ref: Callable, reps: int = 10) -> tuple[float, float]:
    """Median milliseconds of each, from interleaved runs timed with CUDA events."""
    for fn in (ours, ref, ours, ref):
        fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, sink in ((ours, times[0]), (ref, times[1])):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            sink.append(start.elapsed_time(stop))
    return statistics.median(times[0]), statistics.median(times[1])


def _randn(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def bench_matmul(rows: int, target: str, s: Sizes = FULL) -> Row:
    n = s.width
    x, w = _randn(rows, n), _randn(n, n, scale=n**-0.5)
    linear = get_op("linear", DEV)
    ours, ref = cuda_ms(lambda: linear(x, w), lambda: F.linear(x, w), s.reps)
    # the target is on throughput: ours/ref time <= 1/0.8 (train), 1/0.5 (decode)
    return Row("matmul", f"{rows}x{n}->{n}", ours, ref, "cuBLAS", target)


def bench_attention_prefill(s: Sizes = FULL) -> Row:
    tokens, (hq, hkv, d) = s.tokens, s.heads
    q, k, v = _randn(1, hq, tokens, d), _randn(1, hkv, tokens, d), _randn(1, hkv, tokens, d)
    pos = torch.arange(tokens, device=DEV)[None]
    attend = get_op("attention", DEV)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ours, ref = cuda_ms(lambda: attend(q, k, v, q_positions=pos), sdpa, s.reps)
    shape = f"{tokens} tok, {hq}/{hkv} heads, d{d}"
    return Row("attention prefill", shape, ours, ref, "SDPA", "<= 1.5x")


def bench_attention_decode(s: Sizes = FULL) -> Row:
    batch, cache, (hq, hkv, d) = s.decode_batch, s.tokens, s.heads
    q = _randn(batch, hq, 1, d)
    k, v = _randn(batch, hkv, cache, d), _randn(batch, hkv, cache, d)
    pos = torch.full((batch, 1), cache - 1, device=DEV)
    slots = torch.arange(batch, device=DEV)
    attend = get_op("attention", DEV)
    ours, ref = cuda_ms(
        lambda: attend(q, k, v, q_positions=pos, kv_index=slots),
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        s.reps,
    )
    return Row("attention decode", f"{batch} seq x {cache} cache", ours, ref, "SDPA", "<= 2.0x")


def bench_logprobs(s: Sizes = FULL) -> list[Row]:
    tokens, hidden, vocab = s.tokens, s.width, s.vocab
    h, w = _randn(tokens, hidden), _randn(vocab, hidden, scale=hidden**-0.5)
    t = torch.randint(0, vocab, (tokens,), device=DEV)
    fused = get_op("linear_logp", DEV)

    def materialised():
        return torch.log_softmax(F.linear(h, w).float(), -1).gather(-1, t[:, None])[:, 0]

    ours, ref = cuda_ms(lambda: fused(h, w, t), materialised, reps=max(1, s.reps // 2))
    rows = [Row("linear_logp", f"{tokens} tok x {vocab} vocab", ours, ref, "materialised", "")]
    peaks = []
    for fn in (lambda: fused(h, w, t), materialised):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
    rows.append(Row("linear_logp peak MiB", "fused vs materialised", *peaks, "materialised", ""))
    return rows


def bench_train_step(s: Sizes = FULL) -> Row:
    from rl_engine.logprobs import token_logprobs
    from rl_engine.models.build import hf_config, random_model
    from rl_engine.patching import apply_batch_invariant

    (batch, seq), (vocab, hidden, inter, layers, heads) = s.step, s.llama
    config = hf_config(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    with torch.device(DEV):  # initialised on the GPU
        plain = random_model(config, torch.bfloat16)
        patched = random_model(config, torch.bfloat16)
    apply_batch_invariant(patched)
    ids = torch.randint(3, vocab, (batch, seq), device=DEV)

    def step(model):
        model.zero_grad(set_to_none=True)
        token_logprobs(model, ids).sum().backward()

    ours, ref = cuda_ms(lambda: step(patched), lambda: step(plain), reps=max(1, s.reps // 2))
    shape = f"Llama {layers}x{hidden}, {batch}x{seq} tok"
    return Row("train step fwd+bwd", shape, ours, ref, "plain", "<= 1.2x")


def run(s: Sizes = FULL) -> list[Row]:
    rows = [bench_matmul(s.train_rows, "<= 1.25x", s)]  # >= 0.8x cuBLAS throughput
    rows += [bench_matmul(m, "<= 2.0x", s) for m in s.decode_rows]  # >= 0.5x at decode shapes
    rows += [bench_attention_prefill(s), bench_attention_decode(s)]
    rows += bench_logprobs(s)
    rows.append(bench_train_step(s))
    return rows


def render(rows: list[Row]) -> str:
    name = torch.cuda.get_device_name()
    lines = [
        f"device: {name}, torch {torch.__version__}",
        "",
        "| op | shape | ours | reference | ref | ratio | target | verdict |",
        "|---|---|---:|---:|---|---:|---|---|",
    ]
    for r in rows:
        unit = "" if "MiB" in r.what else " ms"
        lines.append(
            f"| {r.what} | {r.shape} | {r.ms_ours:.3f}{unit} | {r.ms_ref:.3f}{unit} | {r.ref} "
            f"| {r.ratio:.2f}x | {r.target} | {r.verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="3 repetitions")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench kernels --device cuda needs a CUDA device")
    sizes = TINY if args.tiny else FULL
    if args.quick:
        sizes = dataclasses.replace(sizes, reps=3)
    table = render(run(sizes))
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return table


if __name__ == "__main__":
    main()
