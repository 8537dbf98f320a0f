"""Executors: the DeepSpeed training worker (the plugin) and the Ray job around it.

- `worker/`: everything a host framework needs to run a DeepSpeed training rank
  (`DeepSpeedTrainingWorker`, `TrainBatch`, batch checks, the step loss, the policy,
  checkpoints, the DeepSpeed config, distributed setup). It imports neither Ray nor `job/`.
- `job/`: this project's Ray job: driver (`run_job`), actors, cluster, run directory,
  faults, job checkpoints, reports, progress, export. It depends on the worker, never
  the reverse (tests/test_layering.py).

Names are imported lazily so that `rl_engine.executors.worker.batch` (used by rollout
actors and the driver) does not pull in DeepSpeed or transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainBatch": "rl_engine.executors.worker.batch",
    "BatchError": "rl_engine.executors.worker.errors",
    "ParityError": "rl_engine.executors.worker.errors",
    "DeepSpeedTrainingWorker": "rl_engine.executors.worker.policy.worker",
    "build_deepspeed_config": "rl_engine.executors.worker.ds_config",
    "CriticWorker": "rl_engine.executors.worker.critic.worker",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rl_engine.executors' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
