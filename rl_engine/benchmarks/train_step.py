"""`rl-engine bench train`: DeepSpeed train-step time and memory, invariance on vs. off.

SmolLM2-135M-Instruct, 8 sequences x 128 tokens (16 prompt + 112 completion),
ZeRO 0 and 3, one rank. For each (dtype, ZeRO) the invariant and the plain
worker live at the same time, each in its own process (so its peak RSS is its
own): both load and initialise, take one warm-up step, then their timed steps
alternate (on, off, off, on, ...) so that machine noise hits both alike; the
figure is the median of each. The rollout logprobs are the worker's own
(ratio 1), so the step does real work without a rollout engine in the loop.

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
REPLY = "@@bench-reply "  # marks the child's answers among DeepSpeed's own prints


def _batch(vocab: int, seed: int = 0):
    from rl_engine.executors.worker.batch import TrainBatch

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
    from rl_engine.executors.worker.deepspeed_trainer import DeepSpeedTrainingWorker

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


def serve_steps(zero_stage: int, invariant: bool, dtype: str) -> None:
    """Child process: build the worker, then answer one line per command on stdin.

    "step" -> {"seconds": s}; "peak" -> {"peak_extra": bytes since the first step}; EOF ends.
    """
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    worker = _worker(zero_stage, invariant, dtype)
    batch = _batch(worker.vocab_size)
    batch.rollout_logprobs = worker.compute_logprobs(batch)  # ratio 1: a real, on-policy step
    reset_peak_rss()
    before = current_rss_bytes()
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for command in sys.stdin:
        if command.strip() == "step":
            start = time.perf_counter()
            worker.train_step(batch)
            reply = {"seconds": time.perf_counter() - start}
        else:
            reply = {"peak_extra": peak_rss_bytes() - before}
        print(REPLY + json.dumps(reply), flush=True)


class _LiveWorker:
    """A `serve_steps` child process, driven one command at a time."""

    def __init__(self, zero_stage: int, invariant: bool, dtype: str):
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        args = [
            sys.executable,
            "-m",
            __name__,
            "serve",
            str(zero_stage),
            str(int(invariant)),
            dtype,
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def ask(self, command: str | None = None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line.removeprefix(REPLY))
        raise RuntimeError(f"benchmark worker {self.proc.args[3:]} exited ({self.proc.wait()})")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def interleaved_case(zero_stage: int, dtype: str, steps: int) -> dict:
    """Invariant and plain worker alive together; timed steps alternate. Medians and peaks."""
    workers = {
        "on": _LiveWorker(zero_stage, True, dtype),
        "off": _LiveWorker(zero_stage, False, dtype),
    }
    try:
        for w in workers.values():
            w.ask()  # ready
        for w in workers.values():
            w.ask("step")  # warm-up
        times = {"on": [], "off": []}
        for i in range(steps):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            for name in order:
                times[name].append(workers[name].ask("step")["seconds"])
        result = {name: statistics.median(t) for name, t in times.items()}
        for name, w in workers.items():
            result[f"{name}_peak"] = w.ask("peak")["peak_extra"]
        return result
    finally:
        for w in workers.values():
            w.close()


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
    steps = 2 if quick else 6
    rows = []
    cells = [(d, z) for d in dtypes for z in (0, 3)]
    for dtype, zero in tqdm(cells, desc="train-step", unit="config"):
        r = interleaved_case(zero, dtype, steps)
        rows.append(
            f"| {dtype} | ZeRO-{zero} | {r['on']:.2f} | {r['off']:.2f} | {r['on'] / r['off']:.2f}x "
            f"| {r['on_peak'] / 2**20:.0f} | {r['off_peak'] / 2**20:.0f} |"
        )
    mem = [(d, _subprocess("logp", "1", d), _subprocess("logp", "0", d)) for d in dtypes]
    lines = [
        f"SmolLM2-135M-Instruct, {SEQS} x {SEQ_LEN} tokens, 1 rank, threads {torch.get_num_threads()}, "
        f"median of {steps} interleaved steps",
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
    if kind == "serve":
        serve_steps(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4])
    else:
        print(json.dumps(logp_memory_case(sys.argv[2] == "1", sys.argv[3])))
