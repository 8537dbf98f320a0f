"""Alias of `rl_engine.executors.worker.policy.setup.worker` (the module path DESIGN.md names)."""

from rl_engine.executors.worker.policy.setup.worker import (
    BatchError,
    DeepSpeedTrainingWorker,
    ParityError,
    build_deepspeed_config,
)

__all__ = ["BatchError", "DeepSpeedTrainingWorker", "ParityError", "build_deepspeed_config"]
