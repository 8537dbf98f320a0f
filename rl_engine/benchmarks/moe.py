"""`rl-engine bench moe`: one mixture-of-experts block, batch-invariant vs. plain Hugging Face, same run.

The block is transformers' Qwen3-MoE sparse block with 64 experts, top-8 and
renormalised weights, hidden 1024, expert width 256 (`Block`; `--tiny` shrinks
it, and takes both peak-memory probes in one process). "plain" is the block as HF runs it here, with the experts implementation
transformers picks for a model on this CPU (`grouped_mm`: `torch._grouped_mm`,
printed in the header) and, for reference, its `eager` loop; "invariant" is the
same block with its router and experts patched (`moe_router`, `moe_experts` of
the CPU's default backend), the same Parameter objects. Shapes: decode (8
tokens) and training (4096 tokens), forward; training also forward + backward.
Ratios are invariant / grouped_mm from interleaved runs (medians).

Memory: the peak extra RSS of one 4096-token forward for 16, 64 and 256 experts
(weights and inputs allocated before the peak is reset), one fresh process per
case: `python -m rl_engine.benchmarks.moe {invariant|grouped_mm|eager} E TOKENS
DTYPE [BLOCK]` prints {"peak_extra": bytes} (BLOCK: the block's sizes as JSON;
default the full ones). The invariant experts run each expert on exactly its
rows, so the peak does not grow with E.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import (
    current_rss_bytes,
    interleaved_ratio,
    peak_extra_memories,
    peak_extra_memory,
    peak_rss_bytes,
    reset_peak_rss,
)
from rl_engine.kernels import get_op, kernel_facts, resolve_backend


@dataclass(frozen=True)
class Block:
    """The block's sizes and the token counts it runs."""

    experts: int = 64
    top_k: int = 8
    hidden: int = 1024
    width: int = 256  # each expert's intermediate size
    train: int = 4096  # tokens
    decode: int = 8
    memory_experts: tuple[int, ...] = (16, 64, 256)


FULL = Block()
# widths that are multiples of 8: HF's grouped_mm runs them in bf16 on a CPU
TINY = Block(experts=8, top_k=2, hidden=32, width=16, train=24, decode=3, memory_experts=(8,))
IMPLEMENTATIONS = ("invariant", "grouped_mm")  # the peak-memory probes


def block(
    implementation: str,
    dtype: torch.dtype,
    experts: int | None = None,
    seed: int = 0,
    sizes: Block = FULL,
):
    """HF's Qwen3-MoE sparse block; implementation 'invariant' patches its router and experts."""
    from rl_engine.models.build import hf_config, qwen3_moe_block
    from rl_engine.patching.moe import InvariantMoeExperts, InvariantMoeRouter

    config = hf_config(
        "qwen3_moe",
        hidden_size=sizes.hidden,
        moe_intermediate_size=sizes.width,
        num_experts=experts or sizes.experts,
        num_experts_per_tok=sizes.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = (
        "grouped_mm" if implementation == "invariant" else implementation
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        moe = qwen3_moe_block(config)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0.0, 0.02)
    moe = moe.to(dtype)
    if implementation == "invariant":
        backend = resolve_backend("cpu")
        tags = (backend, "cpu")
        moe.gate = InvariantMoeRouter(
            moe.gate,
            get_op("moe_router", "cpu"),
            *tags,
            renormalize=True,
            weights_in_model_dtype=True,
        )
        moe.experts = InvariantMoeExperts(moe.experts, get_op("moe_experts", "cpu"), *tags)
    return moe


@dataclass
class Result:
    shape: str
    dtype: str
    ms_invariant: float
    ms_grouped: float
    ms_eager: float

    @property
    def ratio(self) -> float:
        return self.ms_invariant / self.ms_grouped


def _forward(moe, x):
    def run():
        with torch.no_grad():
            moe(x)

    return run


def _train_step(moe, x):
    x = x.detach().requires_grad_()  # as inside a model: the block's input needs its gradient too

    def run():
        moe.zero_grad(set_to_none=True)
        moe(x).float().pow(2).mean().backward()

    return run


def run_timings(dtypes, reps: int, sizes: Block = FULL) -> list[Result]:
    results = []
    decode, train = sizes.decode, sizes.train
    for dtype in dtypes:
        blocks = {
            name: block(name, dtype, sizes=sizes) for name in ("invariant", "grouped_mm", "eager")
        }
        for shape, tokens, step in (
            (f"decode {decode} tok, forward", decode, _forward),
            (f"train {train} tok, forward", train, _forward),
            (f"train {train} tok, forward+backward", train, _train_step),
        ):
            x = torch.randn(1, tokens, sizes.hidden).to(dtype)
            runs = {name: step(moe, x) for name, moe in blocks.items()}
            t_inv, t_grouped = interleaved_ratio(runs["invariant"], runs["grouped_mm"], reps=reps)
            _, t_eager = interleaved_ratio(runs["invariant"], runs["eager"], reps=max(1, reps // 2))
            name = str(dtype).removeprefix("torch.")
            results.append(Result(shape, name, t_inv * 1e3, t_grouped * 1e3, t_eager * 1e3))
            r = results[-1]
            print(  # progress: a slow CPU takes minutes a row (bf16 without native bf16 GEMMs)
                f"{r.shape}, {r.dtype}: invariant {r.ms_invariant:.1f} ms, grouped_mm "
                f"{r.ms_grouped:.1f} ms ({r.ratio:.2f}x), eager {r.ms_eager:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    return results


def run_memory(dtypes, sizes: Block = FULL) -> list[tuple[str, int, dict[str, int]]]:
    """(dtype, experts, {implementation: peak extra bytes}) of one forward of `sizes.train` tokens."""
    out = []
    spec = json.dumps(dataclasses.asdict(sizes))
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for experts in sizes.memory_experts:
            args = (str(experts), str(sizes.train), name, spec)
            if sizes == TINY:  # a smoke run: both probes in one fresh process, invariant first
                peaks = peak_extra_memories(__name__, IMPLEMENTATIONS, *args)
            else:
                peaks = {impl: peak_extra_memory(__name__, impl, *args) for impl in IMPLEMENTATIONS}
            out.append((name, experts, peaks))
    return out


def render(results: list[Result], memory, sizes: Block = FULL) -> str:
    facts = ", ".join(f"{k}={v}" for k, v in kernel_facts("cpu").items())
    lines = [
        f"threads: {torch.get_num_threads()}, torch {torch.__version__}, {facts}; block: "
        f"{sizes.experts} experts, top-{sizes.top_k}, hidden {sizes.hidden}, expert width "
        f"{sizes.width}; plain = HF's "
        "default experts implementation for a model on this CPU: grouped_mm",
        "",
        "| shape | dtype | batch_invariant=true ms | plain grouped_mm ms | plain eager ms | ratio vs grouped_mm |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.shape} | {r.dtype} | {r.ms_invariant:.2f} | {r.ms_grouped:.2f} | {r.ms_eager:.2f} "
        f"| {r.ratio:.2f}x |"
        for r in results
    ]
    if memory:
        lines += [
            "",
            f"| peak extra memory, one {sizes.train}-token forward | experts | invariant MiB | grouped_mm MiB |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {dt} | {e} | {p['invariant'] / 2**20:.0f} | {p['grouped_mm'] / 2**20:.0f} |"
            for dt, e, p in memory
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = bench_parser(__doc__, quick="fp32 only, 3 repetitions").parse_args(argv)
    dtypes = (torch.float32,) if args.quick else (torch.float32, torch.bfloat16)
    sizes, reps = (TINY, 1) if args.tiny else (FULL, 3 if args.quick else 5)
    memory_dtypes = dtypes[:1] if args.tiny else dtypes  # a fresh process per probe (tiny: one)
    table = render(run_timings(dtypes, reps, sizes), run_memory(memory_dtypes, sizes), sizes)
    print(table)
    return table


def _memory_probe(
    implementation: str, experts: int, tokens: int, dtype: str, sizes: Block = FULL
) -> None:
    dt = getattr(torch, dtype)
    moe = block(implementation, dt, experts, sizes=sizes)
    x = torch.randn(1, tokens, sizes.hidden).to(dt)
    with torch.no_grad():
        reset_peak_rss()
        before = current_rss_bytes()
        moe(x)
        print(json.dumps({"peak_extra": peak_rss_bytes() - before}))


if __name__ == "__main__":
    given = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    given["memory_experts"] = tuple(given.get("memory_experts", FULL.memory_experts))
    for implementation in sys.argv[1].split(","):  # each prints its {"peak_extra": bytes} line
        _memory_probe(
            implementation, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Block(**given)
        )
