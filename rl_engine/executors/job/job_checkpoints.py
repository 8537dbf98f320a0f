"""Job checkpoints: everything a run needs to continue, written so that a torn one is never latest.

Layout under RUN_DIR/checkpoints/:

    latest                 name of the newest complete checkpoint ("step000004"), written last
    step000004/            after 4 completed steps (the run continues at step index 4)
        deepspeed/         the DeepSpeed engine checkpoint of every rank (absent if weights_only)
        critic/            PPO only: the critic ranks' DeepSpeed checkpoint (absent if weights_only)
        weights.safetensors  the policy under Hugging Face names (tied names stored once): what
                           the engines serve; written by trainer rank 0, a gathered bucket at a
                           time (older runs have weights.pt, a torch.save of the state dict)
        pending_rollouts/  asynchronous runs (rollout.max_staleness >= 1): the rollouts generated
                           for later steps, as rollout files, and their figures
        state.json         step, weight version, weights_only, the driver's state
        config.yaml        the config snapshot of the run that wrote it

A checkpoint is assembled in `.step000004.tmp/`, renamed into place when every part is
written, and only then named in `latest` (itself an atomic write). A crash at any point
leaves the previous checkpoint and `latest` as they were. The driver holds no weights: the
trainer ranks write them. The driver's sampling seeds and the task's prompts are functions
of (seed, step); a dataset's prompts are a function of (seed, stream position), and the
position is saved in state.json ("driver": {"prompt_position": ...}).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_engine.base.io import write_json_atomic, write_text_atomic
from rl_engine.executors.worker.weights.weights_file import WEIGHTS_FILE, read_weights_file

log = logging.getLogger("rl_engine.job")

LEGACY_WEIGHTS_FILE = "weights.pt"

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
    driver: dict = field(default_factory=dict)
    """The driver's state (state.json "driver"): seed, next_step, prompt_position, ..."""

    @property
    def deepspeed_dir(self) -> Path:
        return self.path / "deepspeed"

    @property
    def critic_dir(self) -> Path:
        """The critic ranks' DeepSpeed checkpoint (PPO runs)."""
        return self.path / "critic"

    @property
    def weights_path(self) -> Path:
        """weights.safetensors, or weights.pt in a checkpoint of an older run."""
        legacy = self.path / LEGACY_WEIGHTS_FILE
        return legacy if legacy.is_file() else self.path / WEIGHTS_FILE

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    def load_weights(self) -> dict[str, torch.Tensor]:
        """The state dict the engines served from this checkpoint on (tied names: one tensor)."""
        if self.weights_path.name == LEGACY_WEIGHTS_FILE:
            return torch.load(self.weights_path, map_location="cpu", weights_only=True)
        return read_weights_file(self.weights_path)


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
    staging: Path,
    *,
    step: int,
    weight_version: int,
    config,
    weights_only: bool,
    driver_state: dict | None = None,
) -> None:
    """The driver's share of a checkpoint: its state and the config snapshot (no weights)."""
    config.to_yaml(staging / "config.yaml")
    write_json_atomic(
        staging / "state.json",
        {
            "step": step,
            "weight_version": weight_version,
            "weights_only": weights_only,
            "driver": {
                "seed": config.seed,
                "next_step": step,
                "rng": "derived from (seed, step)",
                **(driver_state or {}),
            },
        },
    )


def due(config, done: int, stop_requested: bool) -> bool:
    """Checkpoint after `done` steps: every `checkpoint.every` steps, at the end, and on a stop signal."""
    every = config.checkpoint.every
    return done == config.steps or bool(every and done % every == 0) or stop_requested


def save(
    run_dir: Path,
    config,
    trainers,
    *,
    step: int,
    weight_version: int,
    driver_state: dict | None = None,
    critics=(),
    extra=None,
) -> Checkpoint:
    """The checkpoint after `step` steps: the ranks write the weights file (rank 0) and their
    DeepSpeed state (PPO's `critics` theirs, at the same time), then the driver its part
    (`extra(folder) -> dict`: more files of the driver's, e.g. asynchronous RL's pending
    rollouts, and what they add to the driver's state)."""
    from rl_engine.executors.job.faults import gather  # here: reading checkpoints needs no Ray

    started = time.perf_counter()
    staging = begin(run_dir, step)
    weights_only = config.checkpoint.weights_only
    target = None if weights_only else str(staging / "deepspeed")
    weights = str(staging / WEIGHTS_FILE)
    calls = [(a, a.handle.save_checkpoint.remote(target, weights)) for a in trainers]
    if not weights_only:
        calls += [(c, c.handle.save_checkpoint.remote(str(staging / "critic"))) for c in critics]
    gather(calls)
    if extra is not None:
        driver_state = {**(driver_state or {}), **extra(staging)}
    write_driver_part(
        staging,
        step=step,
        weight_version=weight_version,
        config=config,
        weights_only=weights_only,
        driver_state=driver_state,
    )
    checkpoint = commit(run_dir, staging, config.checkpoint.keep_last)
    log.info("checkpoint %s written in %.1f s", checkpoint.path, time.perf_counter() - started)
    return checkpoint


def resume_point(run_dir: Path, resume: bool) -> Checkpoint | None:
    """The checkpoint a run continues from: the latest under `resume`, else None (ValueError
    for a weights-only one, which holds no optimizer state)."""
    start = latest(run_dir) if resume else None
    if start is not None and start.weights_only:
        raise ValueError(
            f"{start.path} is a weights-only checkpoint (checkpoint.weights_only: true): it holds "
            "no optimizer state and cannot resume; export it with rl-engine export instead"
        )
    if resume and start is None:
        log.info("%s has no checkpoint yet: starting it from step 0", run_dir)
    return start


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
    return Checkpoint(
        path, state["step"], state["weight_version"], state["weights_only"], state.get("driver", {})
    )


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
