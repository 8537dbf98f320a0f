"""`rl-engine bench train --case packing`: a GRPO step packed under a token budget vs. padded.

The case: 64 sequences on a SmolLM2-135M-shaped model (random init, its
config: 30 layers, hidden 576, 9 / 3 heads, vocab 49152, tied), bf16, one rank,
ZeRO-0, batch_invariant on. Prompts are 64 tokens; completion lengths are
lognormal with median 128 and sigma 1.0, capped at 1024, from a fixed seed.

- padded: `trainer.packing: false`, micro_batch_size 8 (8 micro-batches, every
  row as wide as the step's longest sequence: the layout before packing);
- packed: `trainer.packing: true`, `max_tokens_per_micro_batch: 4096`
  (micro_batch_size 64, so the budget decides the micro-batches).

Each run is its own process (its peak RSS is its own), one after another in
the order packed, padded, packed, so that slow drift of a shared machine hits
both alike (the median of each layout's steps is reported). A process scores the batch once (the rollout
logprobs: an on-policy step, and a warm-up of every kernel), then times
`train_step`s. Reported: the median step time (`time/train_compute` of a job)
and the peak RSS above the process's RSS before its first step. `--tiny`: 6 short
sequences on a 1-layer model of a tiny config, both layouts in one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import child_env

# (vocab, hidden, intermediate, heads, kv heads): SmolLM2-135M's, and the smoke run's tiny one
SMOLLM2_SHAPE = (49152, 576, 1536, 9, 3)
TINY_SHAPE = (1000, 64, 128, 4, 2)
# One process per run; the cheap layout brackets the expensive one against drift.
ORDER = ("packed", "padded", "packed")
REPLY = "@@bench-packing "


@dataclass(frozen=True)
class Case:
    """The step: its sequences (prompt + lognormal completion), the two layouts, the model."""

    seqs: int = 64
    prompt: int = 64
    median: int = 128
    sigma: float = 1.0
    cap: int = 1024
    seed: int = 17
    padded_micro: int = 8
    budget: int = 4096
    layers: int = 30
    shape: tuple[int, ...] = SMOLLM2_SHAPE
    order: tuple[str, ...] = ORDER


FULL = Case()
TINY = Case(
    seqs=6,
    prompt=4,
    median=6,
    cap=12,
    padded_micro=2,
    budget=32,
    layers=1,
    shape=TINY_SHAPE,
    order=("packed", "padded"),
)


def completion_lengths(case: Case = FULL) -> list[int]:
    """The case's completion lengths: lognormal(log median, sigma), at least 1, capped."""
    g = torch.Generator().manual_seed(case.seed)
    normal = torch.randn(case.seqs, generator=g, dtype=torch.float64)
    raw = torch.exp(math.log(case.median) + case.sigma * normal)
    return [int(v) for v in raw.round().clamp(1, case.cap).tolist()]


def smollm2_shaped_model(layers: int, shape: tuple[int, ...] = SMOLLM2_SHAPE):
    """A randomly initialised Llama of SmolLM2-135M's config (or `shape`), `layers` deep, bf16."""
    from rl_engine.models.build import hf_config, random_model

    vocab, hidden, intermediate, heads, kv_heads = shape
    config = hf_config(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return random_model(config).to(torch.bfloat16)


def _batch(vocab: int, case: Case):
    from rl_engine.executors.worker.batch import TrainBatch

    lengths = completion_lengths(case)
    seqs, prompt = case.seqs, case.prompt
    width = prompt + max(lengths)
    g = torch.Generator().manual_seed(case.seed + 1)
    ids = torch.zeros(seqs, width, dtype=torch.long)
    mask = torch.zeros(seqs, width, dtype=torch.long)
    response = torch.zeros(seqs, width - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, : prompt + n] = torch.randint(3, vocab, (prompt + n,), generator=g)
        mask[i, : prompt + n] = 1
        response[i, prompt - 1 : prompt + n - 1] = True
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        response_mask=response,
        rollout_logprobs=torch.zeros(seqs, width - 1),
        advantages=torch.randn(seqs, generator=g),
        rewards=torch.zeros(seqs),
    )


def _worker(packed: bool, case: Case):
    from rl_engine.config import RunConfig
    from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker

    trainer = (
        {"packing": True, "max_tokens_per_micro_batch": case.budget, "micro_batch_size": case.seqs}
        if packed
        else {"packing": False, "micro_batch_size": case.padded_micro}
    )
    config = RunConfig.from_dict(
        {
            "model": "tiny-llama",  # a spec only: the worker trains the model passed in
            "dtype": "bfloat16",
            "parity": "report",
            "rollout": {
                "prompts_per_step": 1,
                "samples_per_prompt": case.seqs,
                "max_new_tokens": case.cap,
            },
            "trainer": {"lr": 1e-6, "zero_stage": 0, **trainer},
        }
    )
    model = smollm2_shaped_model(case.layers, case.shape)
    return DeepSpeedTrainingWorker(config, device="cpu", model=model)


def serve(packed: bool, case: Case, steps: int, threads: int) -> None:
    """Child process: one scoring pass, then `steps` timed train_steps; prints one JSON line."""
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(threads)
    worker = _worker(packed, case)
    batch = _batch(worker.vocab_size, case)
    batch.rollout_logprobs = worker.compute_logprobs(batch)  # ratio 1: a real, on-policy step
    reset_peak_rss()
    before = current_rss_bytes()
    seconds, metrics = [], None
    for _ in range(steps):
        start = time.perf_counter()
        metrics = worker.train_step(batch)
        seconds.append(time.perf_counter() - start)
    reply = {
        "seconds": seconds,
        "peak_extra": peak_rss_bytes() - before,
        "tokens": metrics["tokens"],
        "parity": metrics["parity/exact_match_fraction"],
    }
    print(REPLY + json.dumps(reply), flush=True)


def _run(layouts: tuple[str, ...], case: Case, steps: int, threads: int) -> list[dict]:
    """One child process serving `layouts` one after the other: a reply each, in order."""
    env = child_env()
    spec = json.dumps(dataclasses.asdict(case))
    packed = ",".join(str(int(name == "packed")) for name in layouts)
    args = [sys.executable, "-m", __name__, packed, spec, str(steps), str(threads)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    replies = [
        json.loads(line.removeprefix(REPLY))
        for line in proc.stdout.splitlines()
        if line.startswith(REPLY)
    ]
    if proc.returncode != 0 or len(replies) != len(layouts):
        raise RuntimeError(f"packing benchmark child {args[3:]} failed:\n{proc.stderr[-3000:]}")
    return replies


def run(case: Case, threads: int, steps: int = 1) -> dict[str, dict]:
    """{layout: {"seconds" (median), "peak" (bytes), "parity" (min)}} over the case's processes
    (a process per layout; `--tiny`, whose figures mean nothing: one for all)."""
    runs = {"padded": [], "packed": []}
    groups = [case.order] if case == TINY else [(name,) for name in case.order]
    for layouts in groups:
        for name, reply in zip(layouts, _run(layouts, case, steps, threads), strict=True):
            runs[name].append(reply)
    return {
        name: {
            "seconds": statistics.median(s for r in rs for s in r["seconds"]),
            "peak": max(r["peak_extra"] for r in rs),
            "parity": min(r["parity"] for r in rs),
        }
        for name, rs in runs.items()
    }


def render(result: dict[str, dict], case: Case, threads: int, steps: int = 1) -> str:
    lengths = completion_lengths(case)
    real = sum(case.prompt + n for n in lengths)
    longest = case.prompt + max(lengths)
    model = "SmolLM2-135M-shaped" if case.shape == SMOLLM2_SHAPE else "tiny"
    p, q = result["padded"], result["packed"]
    seqs, micro, budget = case.seqs, case.padded_micro, case.budget
    return "\n".join(
        [
            f"{model} model ({case.layers} layers, random init), bf16, ZeRO-0, 1 rank, "
            f"threads {threads}; {seqs} sequences: {case.prompt}-token prompts, completions "
            f"lognormal(median {case.median}, sigma {case.sigma}) capped at {case.cap} (seed "
            f"{case.seed}): {real} real tokens, longest {longest} ({seqs * longest} padded); "
            f"median of {steps} step per process, processes in the order {', '.join(case.order)}",
            "",
            "| layout | micro-batches | step s | peak extra MiB | parity |",
            "|---|---|---:|---:|---:|",
            f"| padded (micro_batch_size {micro}) | {-(-seqs // micro)} x {micro} x {longest} | "
            f"{p['seconds']:.2f} | {p['peak'] / 2**20:.0f} | {p['parity']:.4f} |",
            f"| packed (max_tokens_per_micro_batch {budget}) | {packed_count(case)} rows <= "
            f"{budget} | {q['seconds']:.2f} | {q['peak'] / 2**20:.0f} | {q['parity']:.4f} |",
            f"| packed / padded | | {q['seconds'] / p['seconds']:.2f}x | "
            f"{q['peak'] / p['peak'] if p['peak'] else float('nan'):.2f}x | |",
        ]
    )


def packed_count(case: Case = FULL) -> int:
    """The packed layout's micro-batches (rows under the token budget)."""
    from rl_engine.logprobs.packing import plan_micro_batches

    lengths = [case.prompt + n for n in completion_lengths(case)]
    return len(plan_micro_batches(lengths, max_sequences=case.seqs, max_tokens=case.budget))


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="4 of the 30 layers")
    parser.add_argument("--layers", type=int, default=None, help="model layers (default 30)")
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op threads of each child (torch's)"
    )
    args = parser.parse_args(argv)
    case = TINY if args.tiny else FULL
    if args.quick or args.layers:
        case = dataclasses.replace(case, layers=args.layers or 4)
    threads = args.threads or torch.get_num_threads()
    table = render(run(case, threads), case, threads)
    print(table)
    return table


if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    spec.update(shape=tuple(spec["shape"]), order=tuple(spec["order"]))
    for packed in sys.argv[1].split(","):  # "1,0": packed, then padded, in this one process
        serve(packed == "1", Case(**spec), int(sys.argv[3]), int(sys.argv[4]))
