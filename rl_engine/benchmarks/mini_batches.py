"""`rl-engine bench train --case mini-batches`: trainer.parity_scope 'first' (no recompute) vs 'all'.

    DS_ACCELERATOR=cpu .venv/bin/python scripts/bench_mini_batches.py [--steps N] [--model M]

One rank, ZeRO-0, fp32, a random 17M-parameter Llama by default (`--model
smollm2-135m-instruct` for the real one: minutes a step on a shared 2-core machine); 16
sequences x 128 tokens (16 prompt + 112 completion) split into 4 mini-batches of 4 (4
optimizer steps per RL step), micro-batches of 4. The three workers live in this process;
after a warm-up step each, their timed steps alternate so that machine noise hits them alike,
and each figure is the median. 'all' pays one no-grad forward over the last 3 mini-batches
before the first update: what verl pays every step to recompute the old logprobs; 'first'
checks parity on the first mini-batch only and recomputes nothing. The one-update step
(mini_batch_size 0) is the reference. Prints a markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from rl_engine.benchmarks.args import bench_parser


@dataclass(frozen=True)
class Step:
    """The step's batch and how it is split."""

    seqs: int = 16
    seq_len: int = 128
    prompt_len: int = 16
    mini: int = 4  # sequences per mini-batch
    micro: int = 4  # sequences per micro-batch


FULL = Step()
TINY = Step(seqs=4, seq_len=12, prompt_len=4, mini=2, micro=2)
MID_LLAMA = "mid-llama"


def batch(vocab: int, step: Step = FULL):
    from rl_engine.executors.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (step.seqs, step.seq_len), generator=g)
    response = torch.zeros(step.seqs, step.seq_len - 1, dtype=torch.bool)
    response[:, step.prompt_len - 1 :] = True
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response,
        rollout_logprobs=torch.zeros(step.seqs, step.seq_len - 1),
        advantages=torch.randn(step.seqs, generator=g),
        rewards=torch.zeros(step.seqs),
    )


def mid_llama(dtype: str):
    """A random 17M-parameter Llama (6 layers, hidden 384, vocab 8192): big enough that the
    forward and backward, not the step's bookkeeping, take the time; small enough for a shared
    2-core machine."""
    from rl_engine.models.build import hf_config, random_model

    torch.manual_seed(0)
    config = hf_config(
        "llama",
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return random_model(config).to(getattr(torch, dtype))


def worker(model: str, dtype: str, mini: int, scope: str, step: Step = FULL):
    """A one-rank ZeRO-0 worker in this process; `model` is mid-llama (built here) or a spec."""
    from rl_engine.config import RunConfig
    from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker

    config = RunConfig.from_dict(
        {
            "model": "tiny-llama" if model == MID_LLAMA else model,
            "dtype": dtype,
            "parity": "report",  # the batch is off-policy after the first update
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": step.seqs},
            "trainer": {
                "micro_batch_size": step.micro,
                "mini_batch_size": mini,
                "parity_scope": scope,
                "lr": 1e-6,
                "zero_stage": 0,
            },
        }
    )
    policy = mid_llama(dtype) if model == MID_LLAMA else None
    return DeepSpeedTrainingWorker(config, device="cpu", model=policy)


def run(model: str, dtype: str, steps: int, step: Step = FULL) -> dict[str, dict]:
    """{case: {"updates", "seconds" (median)}} for the one-update step and both parity scopes."""
    cases = {
        "one update (mini_batch_size 0)": (0, "all"),
        f"{step.seqs // step.mini} mini-batches, parity_scope first": (step.mini, "first"),
        f"{step.seqs // step.mini} mini-batches, parity_scope all": (step.mini, "all"),
    }
    workers = {name: worker(model, dtype, *case, step) for name, case in cases.items()}
    first = next(iter(workers.values()))
    data = batch(first.vocab_size, step)
    data.rollout_logprobs = first.compute_logprobs(data)
    times = {name: [] for name in workers}
    for name, w in workers.items():
        w.train_step(data)  # warm-up
        print(f"{name}: warmed up", file=sys.stderr, flush=True)
    for i in range(steps):
        names = list(workers) if i % 2 == 0 else list(reversed(workers))
        for name in names:
            start = time.perf_counter()
            metrics = workers[name].train_step(data)
            times[name].append(time.perf_counter() - start)
            print(f"{name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
            expected = 1 if cases[name][0] == 0 else step.seqs // step.mini
            if metrics["updates"] != expected:
                raise RuntimeError(f"{name}: {metrics['updates']} updates, expected {expected}")
    return {
        name: {
            "updates": 1 if mini == 0 else step.seqs // step.mini,
            "seconds": statistics.median(times[name]),
        }
        for name, (mini, _) in cases.items()
    }


def render(results: dict[str, dict], header: str) -> str:
    first = next(r["seconds"] for name, r in results.items() if name.endswith("scope first"))
    lines = [
        header,
        "",
        "| step | updates | s | vs parity_scope first |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {r['updates']} | {r['seconds']:.2f} | {r['seconds'] / first:.2f}x |"
        for name, r in results.items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="1 timed step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--model", default=MID_LLAMA, help="mid-llama (built here) or a load_model spec"
    )
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    step, model, steps = FULL, args.model, 1 if args.quick else args.steps
    if args.tiny:
        step, model, steps = TINY, "tiny-llama", 1
    results = run(model, args.dtype, steps, step)
    header = (
        f"{model}, {args.dtype}, ZeRO-0, 1 rank, {step.seqs} x {step.seq_len} tokens, "
        f"micro-batches of {step.micro}, threads {torch.get_num_threads()}, median of {steps} "
        "interleaved steps"
    )
    table = render(results, header)
    print(table)
    return table
