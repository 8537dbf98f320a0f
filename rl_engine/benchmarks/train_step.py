"""`rl-engine bench train`: DeepSpeed train-step time and memory, invariance on vs. off.

SmolLM2-135M-Instruct, 8 sequences x 128 tokens (16 prompt + 112 completion),
ZeRO 0 and 3, one rank. Each configuration runs in a fresh process (so its peak
RSS is its own): model load, DeepSpeed init, one warm-up step, then the median
of `steps` timed steps. The rollout logprobs are the worker's own (ratio 1), so
the step does real work without a rollout engine in the loop.

Also: peak memory of the logprob path alone (forward + backward), fused
`linear_logp` vs. materialised logits + log_softmax, on the same 1024 tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

SEQS, SEQ_LEN, PROMPT_LEN = 8, 128, 16
MODEL = "smollm2-135m-instruct"


def _batch(vocab: int, seed: int = 0):
    from rl_engine.executors.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
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


def _worker(zero_stage: int, invariant: bool, dtype: str):
    from rl_engine.config import RunConfig
    from rl_engine.executors.deepspeed_trainer import DeepSpeedTrainingWorker

    config = RunConfig.from_dict(
        {
            "model": MODEL,
            "dtype": dtype,
            "batch_invariant": invariant,
            "parity": "report",
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": SEQS},
            "trainer": {"micro_batch_size": SEQS, "lr": 1e-6, "zero_stage": zero_stage},
        }
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def run_case(zero_stage: int, invariant: bool, dtype: str, steps: int) -> dict:
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    worker = _worker(zero_stage, invariant, dtype)
    batch = _batch(worker.vocab_size)
    batch.rollout_logprobs = worker.compute_logprobs(batch)  # ratio 1: a real, on-policy step
    reset_peak_rss()
    before = current_rss_bytes()
    worker.train_step(batch)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        worker.train_step(batch)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_extra": peak_rss_bytes() - before}


def logp_memory_case(fused: bool, dtype: str) -> dict:
    """Peak extra memory of scoring 1024 tokens with forward + backward through the LM head only."""
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from rl_engine.kernels import get_op
    from rl_engine.models import load_model

    model, _ = load_model(MODEL, dtype=getattr(torch, dtype))
    weight = model.lm_head.weight
    hidden = torch.randn(SEQS * SEQ_LEN, weight.shape[1], dtype=weight.dtype, requires_grad=True)
    targets = torch.randint(0, weight.shape[0], (SEQS * SEQ_LEN,))
    reset_peak_rss()
    before = current_rss_bytes()
    if fused:
        logp = get_op("linear_logp", "cpu")(hidden, weight, targets)
    else:
        logits = torch.nn.functional.linear(hidden, weight).float()
        logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    logp.sum().backward()
    return {"peak_extra": peak_rss_bytes() - before}


def _subprocess(*args: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", __name__, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark case {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(*, quick: bool = False) -> str:
    from tqdm import tqdm

    dtypes = ["bfloat16"] if quick else ["float32", "bfloat16"]
    steps = "2" if quick else "3"
    rows = []
    cells = [(d, z) for d in dtypes for z in (0, 3)]
    for dtype, zero in tqdm(cells, desc="train-step", unit="config"):
        on = _subprocess("step", str(zero), "1", dtype, steps)
        off = _subprocess("step", str(zero), "0", dtype, steps)
        rows.append(
            f"| {dtype} | ZeRO-{zero} | {on['seconds']:.2f} | {off['seconds']:.2f} | "
            f"{on['seconds'] / off['seconds']:.2f}x | {on['peak_extra'] / 2**20:.0f} | {off['peak_extra'] / 2**20:.0f} |"
        )
    mem = [(d, _subprocess("logp", "1", d), _subprocess("logp", "0", d)) for d in dtypes]
    lines = [
        f"SmolLM2-135M-Instruct, {SEQS} x {SEQ_LEN} tokens, 1 rank, threads {torch.get_num_threads()}",
        "",
        "| dtype | ZeRO | step s (batch_invariant=true) | step s (batch_invariant=false) | ratio | peak extra MiB (true) | peak extra MiB (false) |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "| logprob path, fwd+bwd, 1024 tokens x 49152 vocab | fused MiB | materialised MiB | ratio |",
        "|---|---:|---:|---:|",
        *[
            f"| {d} | {f['peak_extra'] / 2**20:.0f} | {m['peak_extra'] / 2**20:.0f} | {f['peak_extra'] / m['peak_extra']:.2f} |"
            for d, f, m in mem
        ],
    ]
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "step":
        result = run_case(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], int(sys.argv[5]))
    else:
        result = logp_memory_case(sys.argv[2] == "1", sys.argv[3])
    print(json.dumps(result))
