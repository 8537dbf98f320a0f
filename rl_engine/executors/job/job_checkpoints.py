"""Job checkpoints: everything a run needs to continue, written so that a torn one is never latest.

Layout under RUN_DIR/checkpoints/:

    latest                 name of the newest complete checkpoint ("step000004"), written last
    step000004/            after 4 completed steps (the run continues at step index 4)
        deepspeed/         the DeepSpeed engine checkpoint of every rank (absent if weights_only)
        weights.pt         the policy state dict under Hugging Face names: what the engines serve
        state.json         step, weight version, weights_only, the driver's state
        config.yaml        the config snapshot of the run that wrote it

A checkpoint is assembled in `.step000004.tmp/`, renamed into place when every part is
written, and only then named in `latest` (itself an atomic write). A crash at any point
leaves the previous checkpoint and `latest` as they were. The driver's sampling seeds and
the task's prompts are functions of (seed, step), so the step is the driver's whole state.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_engine.io import FILE_MODE, write_json_atomic, write_text_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One complete checkpoint on disk."""

    path: Path
    step: int
    """Completed steps: the run continues at step index `step`."""
    weight_version: int
    """Weight version the engines serve from this checkpoint on."""
    weights_only: bool

    @property
    def deepspeed_dir(self) -> Path:
        return self.path / "deepspeed"

    @property
    def weights_path(self) -> Path:
        return self.path / "weights.pt"

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    def load_weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.weights_path, map_location="cpu", weights_only=True)


def tag_for(step: int) -> str:
    return f"step{step:06d}"


def begin(run_dir: Path, step: int) -> Path:
    """A fresh staging folder for the checkpoint after `step` steps (stale ones are removed)."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step*.tmp"):
        shutil.rmtree(stale)
    staging = root / f".{tag_for(step)}.tmp"
    staging.mkdir()
    return staging


def write_driver_part(
    staging: Path, *, step: int, weight_version: int, weights, config, weights_only: bool
) -> None:
    """The driver's share of a checkpoint: served weights, state and config snapshot."""
    torch.save(weights, staging / "weights.pt")
    os.chmod(staging / "weights.pt", FILE_MODE)
    config.to_yaml(staging / "config.yaml")
    write_json_atomic(
        staging / "state.json",
        {
            "step": step,
            "weight_version": weight_version,
            "weights_only": weights_only,
            "driver": {"seed": config.seed, "next_step": step, "rng": "derived from (seed, step)"},
        },
    )


def due(config, done: int, stop_requested: bool) -> bool:
    """Checkpoint after `done` steps: every `checkpoint.every` steps, at the end, and on a stop signal."""
    every = config.checkpoint.every
    return done == config.steps or bool(every and done % every == 0) or stop_requested


def save(run_dir: Path, config, trainers, *, step: int, weight_version: int, weights) -> Checkpoint:
    """The checkpoint after `step` steps: every rank's DeepSpeed state, then the driver's part."""
    from rl_engine.executors.job.faults import gather  # here: reading checkpoints needs no Ray

    staging = begin(run_dir, step)
    weights_only = config.checkpoint.weights_only
    if not weights_only:
        target = str(staging / "deepspeed")
        gather([(a, a.handle.save_checkpoint.remote(target)) for a in trainers])
    write_driver_part(
        staging,
        step=step,
        weight_version=weight_version,
        weights=weights,
        config=config,
        weights_only=weights_only,
    )
    return commit(run_dir, staging, config.checkpoint.keep_last)


def commit(run_dir: Path, staging: Path, keep_last: int) -> Checkpoint:
    """Move a fully written staging folder into place, point `latest` at it, prune old ones."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / staging.name[1 : -len(".tmp")]
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    write_text_atomic(root / LATEST, final.name + "\n")
    for old in complete_tags(run_dir)[:-keep_last]:
        shutil.rmtree(root / old)
    return read(final)


def complete_tags(run_dir: Path) -> list[str]:
    """Names of complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    tags = [p.name for p in root.glob("step*") if (p / "state.json").is_file()]
    return sorted(tags)


def read(path: Path) -> Checkpoint:
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    return Checkpoint(path, state["step"], state["weight_version"], state["weights_only"])


def latest(run_dir: Path) -> Checkpoint | None:
    """The checkpoint `latest` names, or None before the first one."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text(encoding="utf-8").strip()
    if not (path / "state.json").is_file():
        raise ValueError(f"{pointer} names {path.name!r}, which is not a complete checkpoint")
    return read(path)


def at_step(run_dir: Path, step: int | None) -> Checkpoint:
    """The checkpoint after `step` steps (latest when None); the error lists what exists."""
    if step is None:
        found = latest(run_dir)
        if found is None:
            raise ValueError(f"{run_dir} has no checkpoint yet")
        return found
    path = Path(run_dir) / CHECKPOINTS / tag_for(step)
    if not (path / "state.json").is_file():
        have = [int(t[len("step") :]) for t in complete_tags(run_dir)]
        raise ValueError(f"{run_dir} has no checkpoint at step {step}; checkpoints at steps {have}")
    return read(path)
