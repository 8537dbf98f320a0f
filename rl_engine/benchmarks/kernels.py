"""`rl-engine bench kernels`: each invariant op vs. its plain-torch counterpart, same run.

Shapes follow issue #2: a training shape (4096 tokens, hidden 1024,
intermediate 2816, vocab 49152) and a decode shape (8 tokens). Reported as
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

from rl_engine.benchmarks.logp_memory import materialised_logprobs
from rl_engine.benchmarks.timing import interleaved_ratio, peak_extra_memory
from rl_engine.kernels import get_op, kernel_facts

TOKENS, HIDDEN, INTERMEDIATE, VOCAB, DECODE = 4096, 1024, 2816, 49152, 8


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


def _linear(rows):
    def build(dt):
        x, w = (
            _randn(rows, HIDDEN, dtype=dt),
            _randn(INTERMEDIATE, HIDDEN, dtype=dt, scale=HIDDEN**-0.5),
        )
        op = get_op("linear", "cpu")
        return (lambda: op(x, w)), (lambda: F.linear(x, w))

    return build


def _rms_norm(rows):
    def build(dt):
        x, w = _randn(rows, HIDDEN, dtype=dt), torch.ones(HIDDEN, dtype=dt)
        op = get_op("rms_norm", "cpu")

        def plain():
            x32 = x.float()
            return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)

        return (lambda: op(x, w, 1e-6)), plain

    return build


def _silu(rows):
    def build(dt):
        x = _randn(rows, INTERMEDIATE, dtype=dt)
        op = get_op("silu", "cpu")
        return (lambda: op(x)), (lambda: F.silu(x))

    return build


def _log_softmax(rows):
    def build(dt):
        x = _randn(rows, VOCAB, dtype=dt, scale=3.0)
        op = get_op("log_softmax", "cpu")
        return (lambda: op(x, 0.7)), (lambda: torch.log_softmax(x.float() / 0.7, -1))

    return build


def _attention_prefill(seq, heads=16, kv_heads=4, head_dim=64):
    def build(dt):
        q = _randn(1, heads, seq, head_dim, dtype=dt)
        k, v = (_randn(1, kv_heads, seq, head_dim, dtype=dt) for _ in range(2))
        pos = torch.arange(seq)[None]
        op = get_op("attention", "cpu")
        return (lambda: op(q, k, v, q_positions=pos)), (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )

    return build


def _attention_decode(batch, cache_len, heads=16, kv_heads=4, head_dim=64):
    def build(dt):
        q = _randn(batch, heads, 1, head_dim, dtype=dt)
        k, v = (_randn(batch, kv_heads, cache_len, head_dim, dtype=dt) for _ in range(2))
        pos = torch.full((batch, 1), cache_len - 1)
        op = get_op("attention", "cpu")
        return (lambda: op(q, k, v, q_positions=pos)), (
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        )

    return build


def _linear_logp(rows):
    def build(dt):
        h, w = _randn(rows, HIDDEN, dtype=dt), _randn(VOCAB, HIDDEN, dtype=dt, scale=HIDDEN**-0.5)
        t = torch.randint(0, VOCAB, (rows,))
        op = get_op("linear_logp", "cpu")
        return (lambda: op(h, w, t)), (lambda: materialised_logprobs(h, w, t))

    return build


def cases(dtypes) -> list[Case]:
    specs = [
        ("linear", f"train {TOKENS}x{HIDDEN}->{INTERMEDIATE}", _linear(TOKENS)),
        ("linear", f"decode {DECODE}x{HIDDEN}->{INTERMEDIATE}", _linear(DECODE)),
        ("rms_norm", f"train {TOKENS}x{HIDDEN}", _rms_norm(TOKENS)),
        ("rms_norm", f"decode {DECODE}x{HIDDEN}", _rms_norm(DECODE)),
        ("silu", f"train {TOKENS}x{INTERMEDIATE}", _silu(TOKENS)),
        ("silu", f"decode {DECODE}x{INTERMEDIATE}", _silu(DECODE)),
        ("log_softmax", f"decode {DECODE}x{VOCAB}", _log_softmax(DECODE)),
        ("attention", "prefill 2048 tok, 16/4 heads, d64", _attention_prefill(2048)),
        ("attention", "decode 8 seq x 512 cache", _attention_decode(DECODE, 512)),
        ("linear_logp", f"train {TOKENS}x{HIDDEN}->{VOCAB}", _linear_logp(TOKENS)),
        ("linear_logp", f"decode {DECODE}x{HIDDEN}->{VOCAB}", _linear_logp(DECODE)),
    ]
    return [Case(op, shape, dt, build) for dt in dtypes for op, shape, build in specs]


def run_timings(dtypes=(torch.float32, torch.bfloat16), reps: int = 5) -> list[Result]:
    results = []
    for case in tqdm(cases(dtypes), desc="kernels", unit="case"):
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


def run_memory(dtypes=("float32", "bfloat16")) -> list[tuple[str, int, int]]:
    """(dtype, fused bytes, materialised bytes) at TOKENS x VOCAB."""
    module = "rl_engine.benchmarks.logp_memory"
    dims = (str(TOKENS), str(HIDDEN), str(VOCAB))
    return [
        (
            dt,
            peak_extra_memory(module, "fused", *dims, dt),
            peak_extra_memory(module, "materialise", *dims, dt),
        )
        for dt in dtypes
    ]


def render(results: list[Result], memory: list[tuple[str, int, int]]) -> str:
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
            f"| {TOKENS} tok x {VOCAB} vocab, {dt} | {f / 2**20:.0f} | {m / 2**20:.0f} | {f / m:.3f} |"
            for dt, f, m in memory
        ]
    return "\n".join(lines)


def main(*, quick: bool = False) -> str:
    dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    results = run_timings(dtypes, reps=3 if quick else 5)
    memory = run_memory(tuple(str(d).removeprefix("torch.") for d in dtypes))
    table = render(results, memory)
    print(table)
    return table
