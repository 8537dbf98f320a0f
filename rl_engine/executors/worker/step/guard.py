"""The all-or-none update: the optimizer's step applied on every rank or on none."""

from __future__ import annotations

import torch

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.optim.adamw import all_finite


class StepGuard:
    """Wraps the torch optimizer's `step` so that an update is applied on all ranks or on none.

    DeepSpeed calls the torch optimizer's step on every rank at the accumulation boundary
    (on the fp32 master partitions under ZeRO), unless it skipped the step itself (ZeRO-3,
    fp32 ZeRO-1/2 and the bf16 optimizer skip on a non-finite gradient norm; plain fp32
    and bf16 ZeRO-1/2 do not). The guard checks this rank's gradients, ORs the flag with
    `force_skip` (set by the worker for a non-finite loss) and all-reduces it: if any rank
    objects, no rank calls the real step, so weights and optimizer state stay untouched.
    `outcome` is 'stepped', 'skipped', or None when DeepSpeed never called the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Collectives):
        self.optimizer, self.comm = optimizer, comm
        self._step = optimizer.step
        optimizer.step = self._guarded_step  # instance attribute: DeepSpeed calls optimizer.step()
        self.force_skip, self.outcome = False, None

    def arm(self, force_skip: bool) -> None:
        self.force_skip, self.outcome = force_skip, None

    @torch.no_grad()
    def _guarded_step(self, *args, **kwargs):
        grads = [
            p.grad
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        bad = self.force_skip or any(not all_finite(g) for g in grads)
        if self.comm.any(bad):
            self.outcome = "skipped"
            return None
        self.outcome = "stepped"
        return self._step(*args, **kwargs)
