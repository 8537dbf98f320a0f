"""`rl-engine bench train --case layout`: the layout-invariant update vs the plain DeepSpeed one.

SmolLM2-135M-Instruct, 2 ranks (gloo, DeepSpeed's CPU accelerator, one thread each), ZeRO-3,
32 sequences of seeded random lengths 64..128 tokens (16 prompt), packing on (the default),
micro_batch_size 4, batch-invariant kernels on, fp32 and bf16. For each dtype the plain update
(`trainer.layout_invariant: false`) and the layout-invariant one (`true`) each run as their 2
rank processes, all four alive at once: they load, take one warm-up step, then their timed
steps alternate (invariant, plain, plain, invariant, ...) so that machine noise hits both
alike; the step time is rank 0's median step (the lower middle one for an even count), and
its CPU seconds (the rank process's own: other load on the machine barely moves them, so the
CPU ratio is the figure to trust on a shared machine).
Memory: each rank's peak RSS over the timed steps (VmHWM, reset after the warm-up step: the
model, its ZeRO-3 partitions and the optimizer states are in it, the load's transient peak is
not), and the two ranks' sum; the ratios use the sum. The rollout logprobs are the worker's own (ratio 1), so each step does real work
without a rollout engine.

The layout-invariant step's parts (rank 0, those of its median step): the timings of
`LayoutInvariantUpdate` (forward + backward with the partials into the sink, whole_gradients,
norm, inject, DeepSpeed's step) and the sink's partial tensors and bytes.
`--tiny`: tiny-llama, 8 x 12 tokens, fp32, one timed step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import child_env

WORLD = 2
TIME_TARGET, MEMORY_TARGET = 1.3, 1.25
REPLY = "@@bench-reply "


@dataclass(frozen=True)
class Case:
    """`seqs` sequences of seeded random lengths in [min_len, max_len], `prompt_len` prompt."""

    model: str = "smollm2-135m-instruct"
    seqs: int = 32
    min_len: int = 64
    max_len: int = 128
    prompt_len: int = 16
    micro_batch_size: int = 4


FULL = Case()
TINY = Case(model="tiny-llama", seqs=8, min_len=12, max_len=12, prompt_len=4, micro_batch_size=2)


def make_batch(vocab: int, case: Case, seed: int = 0):
    """The step's whole batch (the same on every rank), right-padded."""
    from rl_engine.executors.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(case.min_len, case.max_len + 1, (case.seqs,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(3, vocab, (case.seqs, width), generator=g)
    positions = torch.arange(width)
    attention = positions[None, :] < lengths[:, None]
    ids[~attention] = 0
    response = attention[:, 1:] & (positions[None, 1:] >= case.prompt_len)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention.long(),
        response_mask=response,
        rollout_logprobs=torch.zeros(case.seqs, width - 1),
        advantages=torch.randn(case.seqs, generator=g),
        rewards=torch.zeros(case.seqs),
    )


def _worker(layout_invariant: bool, dtype: str, case: Case):
    from rl_engine.config import RunConfig
    from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker

    config = RunConfig.from_dict(
        {
            "model": case.model,
            "dtype": dtype,
            "batch_invariant": True,
            "parity": "report",
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": case.seqs},
            "trainer": {
                "num_ranks": WORLD,
                "zero_stage": 3,
                "micro_batch_size": case.micro_batch_size,
                "lr": 1e-6,
                "layout_invariant": layout_invariant,
            },
        }
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def serve_steps(layout_invariant: bool, dtype: str, case: Case) -> None:
    """One rank (RANK etc. in the environment): answer one line per command on stdin.

    "step" -> {"seconds", "cpu" (the process's CPU seconds: robust to other load), "parts", "held"}; "reset" -> restart the peak-RSS counter;
    "peak" -> {"peak": VmHWM bytes, "extra": VmHWM - RSS at the reset}. DeepSpeed's prints go
    to stderr, so the replies' pipe never fills while the parent reads the other rank.
    """
    from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    worker = _worker(layout_invariant, dtype, case)
    shard = make_batch(worker.vocab_size, case).shard(worker.rank, WORLD)
    shard.rollout_logprobs = worker.compute_logprobs(shard)  # ratio 1: a real, on-policy step
    before = current_rss_bytes()
    print(REPLY + json.dumps({"ready": True}), file=replies, flush=True)
    for command in sys.stdin:
        command = command.strip()
        if command == "step":
            start, cpu = time.perf_counter(), time.process_time()
            worker.train_step(shard)
            reply = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}
            if worker.layout is not None:
                reply |= {"parts": worker.layout.timings, "held": worker.layout.held}
        elif command == "reset":
            reset_peak_rss()
            before = current_rss_bytes()
            reply = {}
        else:
            reply = {"peak": peak_rss_bytes(), "extra": peak_rss_bytes() - before}
        print(REPLY + json.dumps(reply), file=replies, flush=True)


class _Ranks:
    """The 2 rank processes of one configuration, driven one command at a time (both ranks
    get it; the collectives inside keep them in step)."""

    def __init__(self, layout_invariant: bool, dtype: str, case: Case, logs: str):
        from rl_engine.executors.worker.distributed import free_port

        port, spec = free_port(), json.dumps(dataclasses.asdict(case))
        name = f"{dtype}-{'invariant' if layout_invariant else 'plain'}"
        self.logs = [open(f"{logs}/{name}-rank{r}.log", "w") for r in range(WORLD)]  # noqa: SIM115
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, str(int(layout_invariant)), dtype, spec],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=child_env(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(WORLD),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                ),
            )
            for rank, log in enumerate(self.logs)
        ]

    def ask(self, command: str | None = None) -> list[dict]:
        if command is not None:
            for proc in self.procs:
                proc.stdin.write(command + "\n")
                proc.stdin.flush()
        return [self._reply(rank, proc) for rank, proc in enumerate(self.procs)]

    def _reply(self, rank: int, proc) -> dict:
        for line in proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line.removeprefix(REPLY))
        raise RuntimeError(
            f"benchmark rank {rank} {proc.args[3:5]} exited ({proc.wait()}): see {self.logs[rank].name}"
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.stdin.close()
        for proc, log in zip(self.procs, self.logs):
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def interleaved(dtype: str, steps: int, case: Case) -> dict:
    """Both configurations alive together; timed steps alternate. Medians, peaks and parts."""
    with tempfile.TemporaryDirectory(prefix="bench-layout-") as logs:
        ranks = {"invariant": _Ranks(True, dtype, case, logs)}
        ranks["plain"] = _Ranks(False, dtype, case, logs)
        try:
            for r in ranks.values():
                r.ask()  # ready
            for r in ranks.values():
                r.ask("step")  # warm-up
                r.ask("reset")
            replies = {"invariant": [], "plain": []}
            for i in range(steps):
                order = ("invariant", "plain") if i % 2 == 0 else ("plain", "invariant")
                for name in order:
                    replies[name].append(ranks[name].ask("step")[0])
            return {name: _summary(replies[name], ranks[name].ask("peak")) for name in ranks}
        finally:
            for r in ranks.values():
                r.close()


def _summary(steps: list[dict], peaks: list[dict]) -> dict:
    """The median step's time and (layout-invariant) its own parts and sink counts, so that the
    parts add up within the step (medians of each part would not)."""
    middle = sorted(steps, key=lambda s: s["seconds"])[(len(steps) - 1) // 2]
    return {"peaks": peaks, **middle}


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def render(results: list[tuple[str, dict]], case: Case, steps: int) -> str:
    lines = [
        f"{case.model}, {WORLD} ranks x 1 thread, ZeRO-3, {case.seqs} sequences of "
        f"{case.min_len}..{case.max_len} tokens (prompt {case.prompt_len}), packing, "
        f"micro_batch_size {case.micro_batch_size}, batch_invariant, rank 0's median of "
        f"{steps} interleaved steps; peak RSS per rank over the timed steps, MiB",
        "",
        "| dtype | update | step s | step CPU s | peak RSS rank 0 | peak RSS rank 1 "
        "| peak RSS sum | peak extra sum | time ratio | CPU ratio | memory ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, r in results:
        inv, plain = r["invariant"], r["plain"]
        total = {k: sum(p["peak"] for p in v["peaks"]) for k, v in r.items()}
        for name, v in (("plain", plain), ("layout_invariant", inv)):
            key = "invariant" if v is inv else "plain"
            ratios = "| | | |"
            if v is inv:
                t, m = inv["seconds"] / plain["seconds"], total["invariant"] / total["plain"]
                c = inv["cpu"] / plain["cpu"]
                ratios = f"| {t:.2f}x | {c:.2f}x | {m:.2f}x |"
            lines.append(
                f"| {dtype} | {name} | {v['seconds']:.2f} | {v['cpu']:.2f} "
                f"| {_mib(v['peaks'][0]['peak'])} "
                f"| {_mib(v['peaks'][1]['peak'])} | {_mib(total[key])} "
                f"| {_mib(sum(p['extra'] for p in v['peaks']))} {ratios}"
            )
    lines += [
        "",
        f"Targets: time <= {TIME_TARGET}x, memory <= {MEMORY_TARGET}x. "
        "The layout-invariant step's parts (rank 0, s, of its median step; other: the scoring "
        "forward and the metrics):",
        "",
        "| dtype | step s | " + " | ".join(_part_names()) + " | other "
        "| sink tensors at the end | sink peak tensors (bound) | sink MiB at the end |",
        "|---|---:|" + "---:|" * (len(_part_names()) + 4),
    ]
    for dtype, r in results:
        inv = r["invariant"]
        parts, held = inv["parts"], inv["held"]
        other = inv["seconds"] - sum(parts.values())
        lines.append(
            f"| {dtype} | {inv['seconds']:.2f} | "
            + " | ".join(f"{parts[k]:.2f}" for k in parts)
            + f" | {other:.2f} | {held['tensors']} | {held['peak_tensors']} | {_mib(held['bytes'])} |"
        )
    return "\n".join(lines)


def _part_names() -> tuple[str, ...]:
    from rl_engine.executors.worker.layout_free.update import PARTS

    return PARTS


def main(argv: list[str] | None = None) -> str:
    args = bench_parser(__doc__, quick="bfloat16 only").parse_args(argv)
    case, dtypes, steps = FULL, ["float32", "bfloat16"], 3
    if args.quick:
        dtypes = ["bfloat16"]
    if args.tiny:
        case, dtypes, steps = TINY, ["float32"], 1
    results = [(dtype, interleaved(dtype, steps, case)) for dtype in dtypes]
    table = render(results, case, steps)
    print(table)
    return table


if __name__ == "__main__":
    serve_steps(sys.argv[1] == "1", sys.argv[2], Case(**json.loads(sys.argv[3])))
