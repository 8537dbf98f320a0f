"""Print a run's learning curve as a markdown table (what docs/usage.md records).

    python scripts/learning_curve.py runs/smollm2_arithmetic

One row per step: training reward, validation reward where an eval ran (the initial
eval is in step 0's row), parity, step time, and with an environment the fraction of
episodes of more than one model turn (the calculator's tool calls) in training and
validation; then the validation rise and the median step time.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_engine.executors.job.run_dir import read_metrics  # noqa: E402


def main(argv: list[str]) -> None:
    rows = read_metrics(Path(argv[0]))
    if not rows:
        raise SystemExit(f"{argv[0]}: no metrics.jsonl rows")
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


if __name__ == "__main__":
    main(sys.argv[1:])
