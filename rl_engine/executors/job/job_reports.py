"""What a run leaves for people: RUN_DIR/summary.json, training.png, and how to resume it after a stop."""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import asdict
from pathlib import Path

from rl_engine.config import RunConfig
from rl_engine.executors.job.faults import ActorInfo
from rl_engine.executors.job.job_checkpoints import Checkpoint
from rl_engine.base.io import write_json_atomic

log = logging.getLogger("rl_engine.job")


def resume_command(run_dir: Path) -> str:
    return f"rl-engine train --resume {shlex.quote(str(run_dir))}"


def after_stop_note(run_dir: Path, last_checkpoint: Checkpoint | None) -> str:
    """What a stopped run tells its user: the checkpoint it resumes from, and the command."""
    if last_checkpoint is None:
        return f"no checkpoint was written yet; resume starts over: {resume_command(run_dir)}"
    return (
        f"last checkpoint {last_checkpoint.path.name} is intact; resume with: "
        f"{resume_command(run_dir)}"
    )


def write_summary(
    run_dir: Path, config: RunConfig, status: str, history: list[dict], actors: list[ActorInfo]
) -> None:
    """RUN_DIR/summary.json (config, status, every step's metrics, actors) and training.png."""
    summary = {"config": asdict(config), "status": status, "steps": history}
    summary["actors"] = [a.as_dict() for a in actors]
    write_json_atomic(run_dir / "summary.json", summary)
    if history:
        _plot(history, run_dir / "training.png")


def _plot(history: list[dict], path: Path) -> None:
    """Reward (training and validation) and parity per step (a picture of the run); skipped
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no training.png (pip install matplotlib)")
        return
    steps = [m["step"] for m in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [m["reward_mean"] for m in history], marker="o", label="training")
    evals = [m for m in history if "eval/reward_mean" in m]
    if evals:  # validation rows: the initial eval in step 0's row, the others after their step
        ax1.plot(
            [m["step"] for m in evals],
            [m["eval/reward_mean"] for m in evals],
            marker="s",
            label="validation",
        )
        ax1.legend(loc="best")
    ax1.set(title="mean reward", xlabel="step")
    if all("parity/exact_match_fraction" in m for m in history):
        ax2.plot(
            steps,
            [m["parity/exact_match_fraction"] for m in history],
            marker="o",
            label="exact-match fraction",
        )
        ax2.legend(loc="lower right")
    ax2.set(title="trainer == rollout (bitwise)", xlabel="step", ylim=(-0.05, 1.05))
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
