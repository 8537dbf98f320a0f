"""Print a run's learning curve as a markdown table (what docs/usage.md records).

    python scripts/learning_curve.py runs/smollm2_arithmetic
    python scripts/learning_curve.py RUN_A RUN_B ... --plot curves.png   # several runs, one picture

One row per step: training reward, validation reward where an eval ran (the initial
eval is in step 0's row), parity, step time, and with an environment the fraction of
episodes of more than one model turn (the calculator's tool calls) in training and
validation; then the validation rise and the median step time. With several runs, one
table each, and `--plot` draws their training and validation rewards (and, with an
environment, their multi-turn fractions) on one picture, labelled by folder name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_engine.executors.job.run_dir import read_metrics  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with metrics.jsonl)")
    parser.add_argument("--plot", type=Path, help="write the runs' curves to this .png")
    args = parser.parse_args(argv)
    histories = {}
    for run in args.runs:
        rows = read_metrics(run)
        if not rows:
            raise SystemExit(f"{run}: no metrics.jsonl rows")
        if len(args.runs) > 1:
            print(f"\n{run.name}\n")
        table(rows)
        histories[run.name] = rows
    if args.plot is not None:
        plot(histories, args.plot)


def table(rows: list[dict]) -> None:
    episodes = any("env/multi_turn_fraction" in m for m in rows)
    extra = " multi-turn episodes | validation multi-turn |" if episodes else ""
    print("| step | train reward | validation reward | parity exact | tokens | step s |" + extra)
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if episodes else ""))
    for m in rows:
        val = f"{m['eval/reward_mean']:.3f}" if "eval/reward_mean" in m else ""
        line = (
            f"| {m['step']} | {m['reward_mean']:.3f} | {val} | "
            f"{m.get('parity/exact_match_fraction', float('nan')):.4f} | {m['tokens']} | "
            f"{m['time/step']:.1f} |"
        )
        if episodes:
            val_turns = m.get("eval/env/multi_turn_fraction")
            line += f" {m['env/multi_turn_fraction']:.3f} | "
            line += f"{val_turns:.3f} |" if val_turns is not None else " |"
        print(line)
    evals = [m["eval/reward_mean"] for m in rows if "eval/reward_mean" in m]
    if len(evals) >= 2:
        print(
            f"\nvalidation reward {evals[0]:.3f} -> {evals[-1]:.3f} ({evals[-1] - evals[0]:+.3f})"
        )
    steps = [m["time/step"] for m in rows]
    parity = min(m.get("parity/exact_match_fraction", float("nan")) for m in rows)
    print(
        f"median step {statistics.median(steps):.1f} s, total {sum(steps):.0f} s; min parity {parity}"
    )


def plot(histories: dict[str, list[dict]], path: Path) -> None:
    """Training (dashed) and validation (solid) reward of every run; with an environment, a
    second panel of the multi-turn fractions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    episodes = any("env/multi_turn_fraction" in m for rows in histories.values() for m in rows)
    fig, axes = plt.subplots(1, 2 if episodes else 1, figsize=(10 if episodes else 6, 3.5))
    axes = list(axes) if episodes else [axes]
    for name, rows in histories.items():
        evals = [m for m in rows if "eval/reward_mean" in m]
        (line,) = axes[0].plot(
            [m["step"] for m in evals], [m["eval/reward_mean"] for m in evals], "s-", label=name
        )
        steps = [m["step"] for m in rows]
        axes[0].plot(steps, [m["reward_mean"] for m in rows], "--", color=line.get_color(), lw=1)
        if episodes and "env/multi_turn_fraction" in rows[0]:
            fractions = [m["env/multi_turn_fraction"] for m in rows]
            axes[1].plot(steps, fractions, "o-", color=line.get_color(), label=name)
    axes[0].set(title="reward: validation (solid), training (dashed)", xlabel="step")
    axes[0].legend(loc="best", fontsize=8)
    if episodes:
        axes[1].set(title="episodes with more than one turn", xlabel="step", ylim=(-0.05, 1.05))
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
