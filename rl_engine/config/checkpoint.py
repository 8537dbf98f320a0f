"""The `checkpoint:` section: when and what the job checkpoints (executors/job/job_checkpoints.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.base.fields import check_bool, check_int


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and what the job checkpoints (always also after the last step)."""

    every: int = 0
    """Checkpoint every this many steps (0 = only after the last step)."""
    keep_last: int = 2
    """Keep this many newest checkpoints; older ones are deleted after a new one is complete."""
    weights_only: bool = False
    """Save only the policy weights (no optimizer state): smaller, exportable, cannot resume."""

    def __post_init__(self) -> None:
        check_int("checkpoint.every", self.every, 0)
        check_int("checkpoint.keep_last", self.keep_last, 1)
        check_bool("checkpoint.weights_only", self.weights_only)
