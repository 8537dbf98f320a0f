"""Executors: the DeepSpeed training worker, its batch layout, and the Ray job driver.

Names are imported lazily so that `rl_engine.executors.batch` (used by rollout
actors and the driver) does not pull in DeepSpeed or transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainBatch": "rl_engine.executors.batch",
    "BatchError": "rl_engine.executors.errors",
    "ParityError": "rl_engine.executors.errors",
    "DeepSpeedTrainingWorker": "rl_engine.executors.deepspeed_trainer",
    "build_deepspeed_config": "rl_engine.executors.ds_config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rl_engine.executors' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
