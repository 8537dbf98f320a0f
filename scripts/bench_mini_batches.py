"""A step of 4 mini-batches: trainer.parity_scope 'first' (no recompute) vs 'all' (one scoring pass).

    DS_ACCELERATOR=cpu .venv/bin/python scripts/bench_mini_batches.py [--steps N] [--model M]

One rank, ZeRO-0, fp32, a random 17M-parameter Llama by default (`--model
smollm2-135m-instruct` for the real one: minutes a step on a shared 2-core machine); 16 sequences x 128 tokens (16 prompt
+ 112 completion) split into 4 mini-batches of 4 (4 optimizer steps per RL step), micro-batches
of 4. The three workers live in this process; after a warm-up step each, their timed steps
alternate so that machine noise hits them alike, and each figure is the median. 'all' pays
one no-grad forward over the last 3 mini-batches before the first update: what verl pays every
step to recompute the old logprobs; 'first' checks parity on the first mini-batch only and
recomputes nothing. The one-update step (mini_batch_size 0) is the reference.
Prints a markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SEQS, SEQ_LEN, PROMPT_LEN, MINI = 16, 128, 16, 4


def batch(vocab: int):
    from rl_engine.executors.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (SEQS, SEQ_LEN), generator=g)
    response = torch.zeros(SEQS, SEQ_LEN - 1, dtype=torch.bool)
    response[:, PROMPT_LEN - 1 :] = True
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response,
        rollout_logprobs=torch.zeros(SEQS, SEQ_LEN - 1),
        advantages=torch.randn(SEQS, generator=g),
        rewards=torch.zeros(SEQS),
    )


def mid_llama(dtype: str):
    """A random 17M-parameter Llama (6 layers, hidden 384, vocab 8192): big enough that the
    forward and backward, not the step's bookkeeping, take the time; small enough for a shared
    2-core machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(getattr(torch, dtype))


def worker(model: str, dtype: str, mini: int, scope: str):
    from rl_engine.config import RunConfig
    from rl_engine.executors.worker.deepspeed_trainer import DeepSpeedTrainingWorker

    config = RunConfig.from_dict(
        {
            "model": "tiny-llama" if model == "mid-llama" else model,
            "dtype": dtype,
            "parity": "report",  # the batch is off-policy after the first update
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": SEQS},
            "trainer": {
                "micro_batch_size": 4,
                "mini_batch_size": mini,
                "parity_scope": scope,
                "lr": 1e-6,
                "zero_stage": 0,
            },
        }
    )
    policy = mid_llama(dtype) if model == "mid-llama" else None
    return DeepSpeedTrainingWorker(config, device="cpu", model=policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--model", default="mid-llama", help="mid-llama (built here) or a load_model spec"
    )
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    cases = {
        "one update (mini_batch_size 0)": (0, "all"),
        "4 mini-batches, parity_scope first": (MINI, "first"),
        "4 mini-batches, parity_scope all": (MINI, "all"),
    }
    workers = {name: worker(args.model, args.dtype, *case) for name, case in cases.items()}
    data = batch(next(iter(workers.values())).vocab_size)
    data.rollout_logprobs = next(iter(workers.values())).compute_logprobs(data)
    times = {name: [] for name in workers}
    for name, w in workers.items():
        w.train_step(data)  # warm-up
        print(f"{name}: warmed up", file=sys.stderr, flush=True)
    for i in range(args.steps):
        names = list(workers) if i % 2 == 0 else list(reversed(workers))
        for name in names:
            start = time.perf_counter()
            metrics = workers[name].train_step(data)
            times[name].append(time.perf_counter() - start)
            print(f"{name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
            assert metrics["updates"] == (1 if cases[name][0] == 0 else SEQS // MINI)
    median = {name: statistics.median(t) for name, t in times.items()}
    first = median["4 mini-batches, parity_scope first"]
    print(
        f"{args.model}, {args.dtype}, ZeRO-0, 1 rank, {SEQS} x {SEQ_LEN} tokens, micro-batches "
        f"of 4, threads {torch.get_num_threads()}, median of {args.steps} interleaved steps\n"
    )
    print("| step | updates | s | vs parity_scope first |")
    print("|---|---:|---:|---:|")
    for name, seconds in median.items():
        updates = 1 if cases[name][0] == 0 else SEQS // MINI
        print(f"| {name} | {updates} | {seconds:.2f} | {seconds / first:.2f}x |")


if __name__ == "__main__":
    main()
