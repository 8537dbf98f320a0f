"""`rl-engine bench job --case async`: asynchronous RL's step time and overlap, k = 0, 1, 2.

Runs `rl-engine train` on `configs/smollm2_arithmetic.yaml` (SmolLM2-135M bf16, arithmetic
GRPO; `--config` for another) for `--steps` steps with `rollout.max_staleness` k = each of
`--staleness`, one run after the other, and reads every run's metrics.jsonl. Over the steps
after the first (the warm-up), it prints the median and best step time without validation
(`time/step - time/eval`), generation, training and the behaviour check, the mean
`async/overlap` (the share of generation hidden behind training) and each k's median step
time against k = 0's.

On one machine the engines and the ranks share its cores, so overlap hides little: a
generating engine slows the training beside it. The projection below the table is for
engines on nodes of their own, from the k = 0 run's own figures: a synchronous step costs
generation + training + sync, an asynchronous one max(generation, training) + sync + the
behaviour check (measured in the k >= 1 runs), and without the check (`parity: off`, which skips
it). `--set KEY=VALUE` passes more config keys to every run. `--tiny`: tiny-llama on the count task, 3 steps.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.timing import child_env

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "smollm2_arithmetic.yaml"
TINY_JOB = {
    "model": "tiny-llama",
    "dtype": "float32",
    "seed": 0,
    "steps": 3,
    "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 8},
    "trainer": {"micro_batch_size": 4},
}


def run(config: Path, k: int, steps: int, folder: Path, extra: list[str]) -> list[dict]:
    """One `rl-engine train` run with rollout.max_staleness k (and the `extra` --set items);
    its metrics rows."""
    out = folder / f"k{k}"
    sets = [f"steps={steps}", f"rollout.max_staleness={k}", f"output_dir={out}"]
    sets += ["checkpoint.every=0", "logging.backends=[jsonl]", *extra]
    args = ["train", "--config", str(config), "--overwrite"]
    for item in sets:
        args += ["--set", item]
    command = [sys.executable, "-m", "rl_engine.cli", *args]
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"rl-engine {' '.join(args)} failed:\n{proc.stdout[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"  k = {k}: {len(rows)} steps", flush=True)
    return rows


def figures(rows: list[dict]) -> dict[str, float]:
    """Medians (and the best step) over the steps after the first."""
    later = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in later)

    steps = [m["time/step"] - m.get("time/eval", 0.0) for m in later]
    generate = median("time/generate_compute") + median("time/generate_ahead")
    return {
        "step": statistics.median(steps),
        "best": min(steps),
        "generate": generate,
        "train": median("time/train_compute"),
        "sync": median("time/weight_sync"),
        "check": median("time/behaviour_check"),
        "overlap": statistics.fmean(m.get("async/overlap", 0.0) for m in later),
        "staleness": max(m.get("async/staleness_max", 0.0) for m in rows),
        "parity": min(m.get("parity/exact_match_fraction", float("nan")) for m in rows),
    }


def markdown(measured: dict[int, dict[str, float]]) -> str:
    base = measured[min(measured)]["step"]
    lines = [
        "| k | step s (median) | best s | generate s | train s | check s | overlap | "
        "max staleness | parity exact | vs k = 0 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, f in sorted(measured.items()):
        lines.append(
            f"| {k} | {f['step']:.2f} | {f['best']:.2f} | {f['generate']:.2f} | "
            f"{f['train']:.2f} | {f['check']:.2f} | {f['overlap']:.2f} | {f['staleness']:.0f} | "
            f"{f['parity']:.4f} | {base / f['step']:.2f}x |"
        )
    return "\n".join(lines)


def projection(measured: dict[int, dict[str, float]]) -> str:
    """Engines on nodes of their own: generation no longer takes the trainer's cores."""
    sync = measured[0]
    checks = [f["check"] for k, f in measured.items() if k > 0] or [0.0]
    serial = sync["generate"] + sync["train"] + sync["sync"]
    unchecked = max(sync["generate"], sync["train"]) + sync["sync"]
    overlapped = unchecked + max(checks)
    return "\n".join(
        [
            "| layout | step s | vs synchronous |",
            "|---|---:|---:|",
            f"| synchronous: generate + train + sync | {serial:.2f} | 1.00x |",
            f"| asynchronous, engines on their own nodes: max(generate, train) + sync + "
            f"check | {overlapped:.2f} | {serial / overlapped:.2f}x |",
            f"| the same without the behaviour check (parity: off) | {unchecked:.2f} | "
            f"{serial / unchecked:.2f}x |",
        ]
    )


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="3 steps a run")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", default="0,1,2", help="the k values, comma separated")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more config keys"
    )
    args = parser.parse_args(argv)
    ks = sorted({int(k) for k in args.staleness.split(",")} | {0})
    steps = 3 if args.quick or args.tiny else args.steps
    with tempfile.TemporaryDirectory(prefix="rl-engine-bench-async-") as tmp:
        folder, config = Path(tmp), args.config
        if args.tiny:
            from rl_engine.config import RunConfig

            config = folder / "tiny.yaml"
            RunConfig.from_dict({**TINY_JOB, "output_dir": str(folder)}).to_yaml(config)
        measured = {k: figures(run(config, k, steps, folder, args.set)) for k in ks}
    sets = "".join(f" --set {item}" for item in args.set)
    print(f"{config.name}{sets}: {steps} steps a run, figures over steps 1..{steps - 1}")
    table = markdown(measured) + "\n\n" + projection(measured)
    print()
    print(table)
    return table


if __name__ == "__main__":
    main()
