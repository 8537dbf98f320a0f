"""Alias of `rl_engine.executors.worker.policy.worker` (the module path DESIGN.md names)."""

from rl_engine.executors.worker.policy.worker import (
    BatchError,
    DeepSpeedTrainingWorker,
    ParityError,
    build_deepspeed_config,
)

__all__ = ["BatchError", "DeepSpeedTrainingWorker", "ParityError", "build_deepspeed_config"]
