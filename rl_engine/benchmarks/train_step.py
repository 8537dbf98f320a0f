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
`--tiny`: tiny-llama, 4 x 12 tokens, fp32, ZeRO-0 only, one timed step, both logprob
probes in one process.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import child_env

MODEL = "smollm2-135m-instruct"
REPLY = "@@bench-reply "  # marks the child's answers among DeepSpeed's own prints


@dataclass(frozen=True)
class Case:
    """The model and the step's batch: `seqs` sequences of `seq_len` tokens, `prompt_len` prompt."""

    model: str = MODEL
    seqs: int = 8
    seq_len: int = 128
    prompt_len: int = 16


FULL = Case()
TINY = Case(model="tiny-llama", seqs=4, seq_len=12, prompt_len=4)


def _batch(vocab: int, case: Case, seed: int = 0):
    from rl_engine.executors.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (case.seqs, case.seq_len), generator=g)
    response = torch.zeros(case.seqs, case.seq_len - 1, dtype=torch.bool)
    response[:, case.prompt_len - 1 :] = True
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response,
        rollout_logprobs=torch.zeros(case.seqs, case.seq_len - 1),
        advantages=torch.randn(case.seqs, generator=g),
        rewards=torch.zeros(case.seqs),
    )


def _worker(zero_stage: int, invariant: bool, dtype: str, case: Case):
    from rl_engine.config import RunConfig
    from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker

    config = RunConfig.from_dict(
        {
            "model": case.model,
            "dtype": dtype,
            "batch_invariant": invariant,
            "parity": "report",
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": case.seqs},
            "trainer": {"micro_batch_size": case.seqs, "lr": 1e-6, "zero_stage": zero_stage},
        }
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def serve_steps(zero_stage: int, invariant: bool, dtype: str, case: Case) -> None:
    """Child process: build the worker, then answer one line per command on stdin.

    "step" -> {"seconds": s}; "peak" -> {"peak_extra": bytes since the first step}; EOF ends.
    """
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    worker = _worker(zero_stage, invariant, dtype, case)
    batch = _batch(worker.vocab_size, case)
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

    def __init__(self, zero_stage: int, invariant: bool, dtype: str, case: Case):
        env = child_env()
        args = [
            sys.executable,
            "-m",
            __name__,
            "serve",
            str(zero_stage),
            str(int(invariant)),
            dtype,
            json.dumps(dataclasses.asdict(case)),
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


def interleaved_case(zero_stage: int, dtype: str, steps: int, case: Case = FULL) -> dict:
    """Invariant and plain worker alive together; timed steps alternate. Medians and peaks."""
    workers = {
        "on": _LiveWorker(zero_stage, True, dtype, case),
        "off": _LiveWorker(zero_stage, False, dtype, case),
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


def logp_memory_case(fused: bool, dtype: str, case: Case = FULL) -> dict:
    """Peak extra memory of scoring the batch's tokens with forward + backward through the LM head only."""
    return {"peak_extra": _logp_peaks((fused,), dtype, case)[fused]}


def _logp_peaks(variants, dtype: str, case: Case) -> dict[bool, int]:
    """{fused: peak extra bytes} of each variant, one after the other in this process."""
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from rl_engine.kernels import get_op
    from rl_engine.models import load_model

    model, _ = load_model(case.model, dtype=getattr(torch, dtype))
    weight = model.lm_head.weight
    tokens = case.seqs * case.seq_len
    peaks = {}
    for fused in variants:
        hidden = torch.randn(tokens, weight.shape[1], dtype=weight.dtype, requires_grad=True)
        targets = torch.randint(0, weight.shape[0], (tokens,))
        reset_peak_rss()
        before = current_rss_bytes()
        if fused:
            logp = get_op("linear_logp", "cpu")(hidden, weight, targets)
        else:
            logits = torch.nn.functional.linear(hidden, weight).float()
            logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        logp.sum().backward()
        peaks[fused] = peak_rss_bytes() - before
    return peaks


def logp_memory_pair(dtype: str, case: Case, *, one_process: bool) -> tuple[int, int]:
    """(fused, materialised) peak extra bytes: each in a fresh process, or (`--tiny`, whose
    figures mean nothing) both in one, fused first."""
    spec = json.dumps(dataclasses.asdict(case))
    if one_process:
        peaks = _subprocess("logp", "both", dtype, spec)
        return peaks["fused"], peaks["materialised"]
    fused, plain = (_subprocess("logp", flag, dtype, spec)["peak_extra"] for flag in ("1", "0"))
    return fused, plain


def _subprocess(*args: str) -> dict:
    env = child_env()
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


def run(case: Case, dtypes, stages, steps: int) -> tuple[list[tuple], list[tuple]]:
    """([(dtype, stage, interleaved_case result)], [(dtype, fused peak, materialised peak)])."""
    from tqdm import tqdm

    steps_table = []
    for dtype, zero in tqdm([(d, z) for d in dtypes for z in stages], desc="train-step"):
        steps_table.append((dtype, zero, interleaved_case(zero, dtype, steps, case)))
    one_process = case == TINY
    memory = [(d, *logp_memory_pair(d, case, one_process=one_process)) for d in dtypes]
    return steps_table, memory


def render(steps_table, memory, case: Case, steps: int) -> str:
    rows = [
        f"| {dtype} | ZeRO-{zero} | {r['on']:.2f} | {r['off']:.2f} | {r['on'] / r['off']:.2f}x "
        f"| {r['on_peak'] / 2**20:.0f} | {r['off_peak'] / 2**20:.0f} |"
        for dtype, zero, r in steps_table
    ]
    tokens = case.seqs * case.seq_len
    lines = [
        f"{case.model}, {case.seqs} x {case.seq_len} tokens, 1 rank, threads "
        f"{torch.get_num_threads()}, median of {steps} interleaved steps",
        "",
        "| dtype | ZeRO | step s (batch_invariant=true) | step s (batch_invariant=false) | ratio "
        "| peak extra MiB (true) | peak extra MiB (false) |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"| logprob path, fwd+bwd, {tokens} tokens | fused MiB | materialised MiB | ratio |",
        "|---|---:|---:|---:|",
        *[
            f"| {d} | {f / 2**20:.0f} | {m / 2**20:.0f} | {f / m if m else float('nan'):.2f} |"
            for d, f, m in memory
        ],
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = bench_parser(__doc__, quick="bfloat16 only, 2 timed steps").parse_args(argv)
    case, dtypes, stages = FULL, ["float32", "bfloat16"], (0, 3)
    steps = 2 if args.quick else 6
    if args.quick:
        dtypes = ["bfloat16"]
    if args.tiny:
        case, dtypes, stages, steps = TINY, ["float32"], (0,), 1
    table = render(*run(case, dtypes, stages, steps), case, steps)
    print(table)
    return table


if __name__ == "__main__":
    kind, spec = sys.argv[1], json.loads(sys.argv[-1])
    if kind == "serve":
        serve_steps(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], Case(**spec))
    elif sys.argv[2] == "both":
        peaks = _logp_peaks((True, False), sys.argv[3], Case(**spec))
        print(json.dumps({"fused": peaks[True], "materialised": peaks[False]}))
    else:
        print(json.dumps(logp_memory_case(sys.argv[2] == "1", sys.argv[3], Case(**spec))))
