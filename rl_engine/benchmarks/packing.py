"""`rl-engine bench train --case packing`: a GRPO step packed under a token budget vs. padded.

The case (issue 17): 64 sequences on a SmolLM2-135M-shaped model (random init, its
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
and the peak RSS above the process's RSS before its first step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

SEQS, PROMPT, MEDIAN, SIGMA, CAP, SEED = 64, 64, 128, 1.0, 1024, 17
PADDED_MICRO, BUDGET = 8, 4096
# One process per run; the cheap layout brackets the expensive one against drift.
ORDER = ("packed", "padded", "packed")
REPLY = "@@bench-packing "


def completion_lengths(seed: int = SEED) -> list[int]:
    """The case's completion lengths: lognormal(log 128, 1.0), at least 1, capped at 1024."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(SEQS, generator=g, dtype=torch.float64)
    raw = torch.exp(math.log(MEDIAN) + SIGMA * normal)
    return [int(v) for v in raw.round().clamp(1, CAP).tolist()]


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _batch(vocab: int):
    from rl_engine.executors.worker.batch import TrainBatch

    lengths = completion_lengths()
    width = PROMPT + max(lengths)
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.zeros(SEQS, width, dtype=torch.long)
    mask = torch.zeros(SEQS, width, dtype=torch.long)
    response = torch.zeros(SEQS, width - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, : PROMPT + n] = torch.randint(3, vocab, (PROMPT + n,), generator=g)
        mask[i, : PROMPT + n] = 1
        response[i, PROMPT - 1 : PROMPT + n - 1] = True
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        response_mask=response,
        rollout_logprobs=torch.zeros(SEQS, width - 1),
        advantages=torch.randn(SEQS, generator=g),
        rewards=torch.zeros(SEQS),
    )


def _worker(packed: bool, layers: int):
    from rl_engine.config import RunConfig
    from rl_engine.executors.worker.deepspeed_trainer import DeepSpeedTrainingWorker

    trainer = (
        {"packing": True, "max_tokens_per_micro_batch": BUDGET, "micro_batch_size": SEQS}
        if packed
        else {"packing": False, "micro_batch_size": PADDED_MICRO}
    )
    config = RunConfig.from_dict(
        {
            "model": "tiny-llama",  # a spec only: the worker trains the model passed in
            "dtype": "bfloat16",
            "parity": "report",
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": SEQS, "max_new_tokens": CAP},
            "trainer": {"lr": 1e-6, "zero_stage": 0, **trainer},
        }
    )
    return DeepSpeedTrainingWorker(config, device="cpu", model=_model(layers))


def serve(packed: bool, layers: int, steps: int, threads: int) -> None:
    """Child process: one scoring pass, then `steps` timed train_steps; prints one JSON line."""
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(threads)
    worker = _worker(packed, layers)
    batch = _batch(worker.vocab_size)
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


def _run(packed: bool, layers: int, steps: int, threads: int) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    args = [sys.executable, "-m", __name__, str(int(packed)), str(layers), str(steps), str(threads)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(REPLY):
            return json.loads(line.removeprefix(REPLY))
    raise RuntimeError(f"packing benchmark child {args[3:]} failed:\n{proc.stderr[-3000:]}")


def main(*, quick: bool = False, layers: int | None = None, threads: int | None = None) -> str:
    """quick: 4 of the 30 layers. threads: intra-op threads of each child (default torch's)."""
    layers = layers or (4 if quick else 30)
    threads = threads or torch.get_num_threads()
    steps = 1
    runs = {"padded": [], "packed": []}
    for name in ORDER:
        runs[name].append(_run(name == "packed", layers, steps, threads))
    lengths = completion_lengths()
    real = sum(PROMPT + n for n in lengths)
    longest = PROMPT + max(lengths)
    result = {
        name: {
            "seconds": statistics.median(s for r in rs for s in r["seconds"]),
            "peak": max(r["peak_extra"] for r in rs),
            "parity": min(r["parity"] for r in rs),
        }
        for name, rs in runs.items()
    }
    p, q = result["padded"], result["packed"]
    lines = [
        f"SmolLM2-135M-shaped model ({layers} layers, random init), bf16, ZeRO-0, 1 rank, "
        f"threads {threads}; {SEQS} sequences: {PROMPT}-token prompts, completions "
        f"lognormal(median {MEDIAN}, sigma {SIGMA}) capped at {CAP} (seed {SEED}): {real} real "
        f"tokens, longest {longest} ({SEQS * longest} padded); median of "
        f"{steps} step per process, processes in the order {', '.join(ORDER)}",
        "",
        "| layout | micro-batches | step s | peak extra MiB | parity |",
        "|---|---|---:|---:|---:|",
        f"| padded (micro_batch_size {PADDED_MICRO}) | {SEQS // PADDED_MICRO} x {PADDED_MICRO} x "
        f"{longest} | {p['seconds']:.1f} | {p['peak'] / 2**20:.0f} | {p['parity']:.4f} |",
        f"| packed (max_tokens_per_micro_batch {BUDGET}) | {_packed_count()} rows <= {BUDGET} | "
        f"{q['seconds']:.1f} | {q['peak'] / 2**20:.0f} | {q['parity']:.4f} |",
        f"| packed / padded | | {q['seconds'] / p['seconds']:.2f}x | {q['peak'] / p['peak']:.2f}x | |",
    ]
    table = "\n".join(lines)
    print(table)
    return table


def _packed_count() -> int:
    from rl_engine.packing import plan_micro_batches

    lengths = [PROMPT + n for n in completion_lengths()]
    return len(plan_micro_batches(lengths, max_sequences=SEQS, max_tokens=BUDGET))


if __name__ == "__main__":
    serve(sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
