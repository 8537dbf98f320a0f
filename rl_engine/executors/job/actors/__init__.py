"""The job's Ray actors, one module per kind, and how the driver places and starts them.

- `rollout`: `RolloutActor`, one rollout engine (or one rank of a tensor-parallel engine);
- `trainers`: `TrainerActor` (a DeepSpeed rank of the policy) and `CriticActor` (PPO's critic);
- `launch`: their Ray resources, placement, spawning, the kernel-parity check and start;
- `process`: what every actor process does for itself (its device, GPU index, quiet model
  loading, handing freed heap back to the OS) and what every actor answers (`describe`,
  `free_port`).

The driver's calls to started actors live with the step stage that makes them
(`rollouts`, `training`, `weight_sync`).
"""

from rl_engine.executors.job.actors.rollout import RolloutActor
from rl_engine.executors.job.actors.trainers import CriticActor, TrainerActor

__all__ = ["CriticActor", "RolloutActor", "TrainerActor"]
