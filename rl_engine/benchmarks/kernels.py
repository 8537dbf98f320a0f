"""`rl-engine bench kernels`: each invariant op vs. its plain-torch counterpart, same run.

Shapes (`Sizes`): a training shape (4096 tokens, hidden 1024, intermediate
2816, vocab 49152) and a decode shape (8 tokens); `--tiny` shrinks them. Reported as
time(invariant) / time(plain) from interleaved runs, plus the peak extra memory
of `linear_logp` against materialising the logits. "Invariant" is the CPU's
default backend (`get_op(name, "cpu")`, the cpp kernels); the header names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.logp_memory import materialised_logprobs
from rl_engine.benchmarks.timing import interleaved_ratio, peak_extra_memories, peak_extra_memory
from rl_engine.kernels import get_op, kernel_facts


@dataclass(frozen=True)
class Sizes:
    """The cases' shapes: a training and a decode batch of one transformer layer."""

    tokens: int = 4096
    hidden: int = 1024
    intermediate: int = 2816
    vocab: int = 49152
    decode: int = 8
    prefill: int = 2048  # attention prefill tokens
    cache: int = 512  # attention decode cache length
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64


FULL = Sizes()
TINY = Sizes(
    tokens=24,
    hidden=40,
    intermediate=72,
    vocab=300,
    decode=3,
    prefill=20,
    cache=17,
    heads=4,
    kv_heads=2,
    head_dim=16,
)


@dataclass
class Case:
    op: str
    shape: str
    dtype: torch.dtype
    build: Callable[[torch.dtype], tuple[Callable, Callable]]  # -> (invariant, plain)


@dataclass
class Result:
    op: str
    shape: str
    dtype: str
    ms_invariant: float
    ms_plain: float

    @property
    def ratio(self) -> float:
        return self.ms_invariant / self.ms_plain


def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def _linear(rows, s: Sizes):
    def build(dt):
        x = _randn(rows, s.hidden, dtype=dt)
        w = _randn(s.intermediate, s.hidden, dtype=dt, scale=s.hidden**-0.5)
        op = get_op("linear", "cpu")
        return (lambda: op(x, w)), (lambda: F.linear(x, w))

    return build


def _rms_norm(rows, s: Sizes):
    def build(dt):
        x, w = _randn(rows, s.hidden, dtype=dt), torch.ones(s.hidden, dtype=dt)
        op = get_op("rms_norm", "cpu")

        def plain():
            x32 = x.float()
            return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)

        return (lambda: op(x, w, 1e-6)), plain

    return build


def _silu(rows, s: Sizes):
    def build(dt):
        x = _randn(rows, s.intermediate, dtype=dt)
        op = get_op("silu", "cpu")
        return (lambda: op(x)), (lambda: F.silu(x))

    return build


def _log_softmax(rows, s: Sizes):
    def build(dt):
        x = _randn(rows, s.vocab, dtype=dt, scale=3.0)
        op = get_op("log_softmax", "cpu")
        return (lambda: op(x, 0.7)), (lambda: torch.log_softmax(x.float() / 0.7, -1))

    return build


def attention_prefill(seq, heads=16, kv_heads=4, head_dim=64):
    """Builder of a causal prefill case: dtype -> (the CPU's attention op, SDPA)."""

    def build(dt):
        q = _randn(1, heads, seq, head_dim, dtype=dt)
        k, v = (_randn(1, kv_heads, seq, head_dim, dtype=dt) for _ in range(2))
        pos = torch.arange(seq)[None]
        op = get_op("attention", "cpu")
        return (lambda: op(q, k, v, q_positions=pos)), (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )

    return build


def attention_decode(batch, cache_len, heads=16, kv_heads=4, head_dim=64):
    """Builder of a decode case (one query per sequence over its whole cache): dtype -> (op, SDPA)."""

    def build(dt):
        q = _randn(batch, heads, 1, head_dim, dtype=dt)
        k, v = (_randn(batch, kv_heads, cache_len, head_dim, dtype=dt) for _ in range(2))
        pos = torch.full((batch, 1), cache_len - 1)
        op = get_op("attention", "cpu")
        return (lambda: op(q, k, v, q_positions=pos)), (
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        )

    return build


def _linear_logp(rows, s: Sizes):
    def build(dt):
        h = _randn(rows, s.hidden, dtype=dt)
        w = _randn(s.vocab, s.hidden, dtype=dt, scale=s.hidden**-0.5)
        t = torch.randint(0, s.vocab, (rows,))
        op = get_op("linear_logp", "cpu")
        return (lambda: op(h, w, t)), (lambda: materialised_logprobs(h, w, t))

    return build


def cases(dtypes, s: Sizes = FULL) -> list[Case]:
    heads = (s.heads, s.kv_heads, s.head_dim)
    specs = [
        ("linear", f"train {s.tokens}x{s.hidden}->{s.intermediate}", _linear(s.tokens, s)),
        ("linear", f"decode {s.decode}x{s.hidden}->{s.intermediate}", _linear(s.decode, s)),
        ("rms_norm", f"train {s.tokens}x{s.hidden}", _rms_norm(s.tokens, s)),
        ("rms_norm", f"decode {s.decode}x{s.hidden}", _rms_norm(s.decode, s)),
        ("silu", f"train {s.tokens}x{s.intermediate}", _silu(s.tokens, s)),
        ("silu", f"decode {s.decode}x{s.intermediate}", _silu(s.decode, s)),
        ("log_softmax", f"decode {s.decode}x{s.vocab}", _log_softmax(s.decode, s)),
        (
            "attention",
            f"prefill {s.prefill} tok, {s.heads}/{s.kv_heads} heads, d{s.head_dim}",
            attention_prefill(s.prefill, *heads),
        ),
        (
            "attention",
            f"decode {s.decode} seq x {s.cache} cache",
            attention_decode(s.decode, s.cache, *heads),
        ),
        ("linear_logp", f"train {s.tokens}x{s.hidden}->{s.vocab}", _linear_logp(s.tokens, s)),
        ("linear_logp", f"decode {s.decode}x{s.hidden}->{s.vocab}", _linear_logp(s.decode, s)),
    ]
    return [Case(op, shape, dt, build) for dt in dtypes for op, shape, build in specs]


def run_timings(
    dtypes=(torch.float32, torch.bfloat16), reps: int = 5, s: Sizes = FULL
) -> list[Result]:
    results = []
    for case in tqdm(cases(dtypes, s), desc="kernels", unit="case"):
        ours, plain = case.build(case.dtype)
        with torch.no_grad():
            t_ours, t_plain = interleaved_ratio(ours, plain, reps=reps)
        results.append(
            Result(
                case.op,
                case.shape,
                str(case.dtype).removeprefix("torch."),
                t_ours * 1e3,
                t_plain * 1e3,
            )
        )
    return results


def run_memory(dtypes=("float32", "bfloat16"), s: Sizes = FULL) -> list[tuple[str, int, int]]:
    """(dtype, fused bytes, materialised bytes) at tokens x vocab."""
    module, cases = "rl_engine.benchmarks.logp_memory", ("fused", "materialise")
    dims = (str(s.tokens), str(s.hidden), str(s.vocab))
    if s == TINY:  # a smoke run: both probes in one fresh process, fused first
        peaks = [peak_extra_memories(module, cases, *dims, dt) for dt in dtypes]
    else:
        peaks = [{c: peak_extra_memory(module, c, *dims, dt) for c in cases} for dt in dtypes]
    return [(dt, p["fused"], p["materialise"]) for dt, p in zip(dtypes, peaks, strict=True)]


def render(results: list[Result], memory: list[tuple[str, int, int]], s: Sizes = FULL) -> str:
    facts = ", ".join(f"{k}={v}" for k, v in kernel_facts("cpu").items())
    lines = [
        f"threads: {torch.get_num_threads()}, torch {torch.__version__}, {facts}",
        "",
        "| op | shape | dtype | batch_invariant=true ms | batch_invariant=false (plain torch) ms | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r.op} | {r.shape} | {r.dtype} | {r.ms_invariant:.2f} | {r.ms_plain:.2f} | {r.ratio:.2f}x |"
        for r in results
    ]
    if memory:
        lines += [
            "",
            "| linear_logp peak extra memory | fused MiB | materialised MiB | fused / materialised |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {s.tokens} tok x {s.vocab} vocab, {dt} | {f / 2**20:.0f} | {m / 2**20:.0f} | "
            f"{f / m if m else float('nan'):.3f} |"
            for dt, f, m in memory
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = bench_parser(__doc__, quick="fp32 only, fewer repetitions").parse_args(argv)
    dtypes = (torch.float32,) if args.quick else (torch.float32, torch.bfloat16)
    sizes, reps = (TINY, 1) if args.tiny else (FULL, 3 if args.quick else 5)
    results = run_timings(dtypes, reps=reps, s=sizes)
    memory_dtypes = dtypes[:1] if args.tiny else dtypes  # a fresh process per probe (tiny: one)
    memory = run_memory(tuple(str(d).removeprefix("torch.") for d in memory_dtypes), sizes)
    table = render(results, memory, sizes)
    print(table)
    return table
