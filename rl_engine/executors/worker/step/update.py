"""How a worker's optimizer step forms its gradients: one protocol, two updates.

Both workers (the policy, PPO's critic) run the same step loop (`step.loop.StepLoop`); what
differs between DeepSpeed's own update and the layout-free one sits behind `Update`, chosen
once when the worker is built (`update_kind`: the one reader of `trainer.layout_invariant`).

- `PlainUpdate`: DeepSpeed's backward, all-reduce, clip and step; the micro-batch loss is
  scaled by the accumulation steps x ranks; metrics are all-reduced sums.
- `layout_free.update.LayoutFreeUpdate`: per-sequence gradient partials summed by a canonical
  tree, written into DeepSpeed's partitions before its step; each token's loss weighted by
  exact global counts; metrics are per-sequence records totalled exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rl_engine.config import RunConfig
from rl_engine.exact.records import SequenceRecords, Sums
from rl_engine.executors.worker.layout_free.update import LayoutFreeUpdate
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.optim.adamw import adamw


class Update(Protocol):
    """One optimizer step's gradient path, driven by `StepLoop` in this order per step:
    `new_step`; per mini-batch `start`, per micro-batch `route_micro_batch` (before its
    forward), then after the last backward `finish` (before DeepSpeed's step) and `stepped`
    (after it)."""

    layout_free: bool
    """Whether metrics are per-sequence records totalled exactly (and checkpoints layout-free)."""
    loss_scale: int | None
    """What a micro-batch's aggregated loss is multiplied by; None: exact per-token weights."""
    norm: float | None
    """The gradient norm of the last update of this step (None: none taken, or unknown)."""

    def new_step(self) -> None: ...

    def start(self, per_rank: int) -> None: ...

    def route_micro_batch(self, mini: int, mb: MicroBatch | None) -> None: ...

    def finish(self, max_norm: float) -> None: ...

    def stepped(self) -> None: ...

    def empty_sums(self, kind: type[Sums]) -> Sums | SequenceRecords: ...

    def totals(self, sums: Sums | SequenceRecords, comm) -> Sums: ...


class PlainUpdate:
    """DeepSpeed's own update: its reduction, clip and step; `norm` is DeepSpeed's, or (plain
    ZeRO-0 fp32, where DeepSpeed reports none) the `.grad` norm before its step clears them."""

    layout_free = False
    make_optimizer = staticmethod(adamw)

    def __init__(self, model, engine, optimizer, *, rank: int, world: int, zero_stage: int):
        self.engine = engine
        # engine.backward divides by DeepSpeed's gradient_accumulation_steps: undone here
        self.loss_scale = engine.gradient_accumulation_steps() * world
        fp32 = not (engine.bfloat16_enabled() or engine.fp16_enabled())
        self._grad_norm_before_step = zero_stage == 0 and fp32
        self._norm_before_step: float | None = None
        self.norm: float | None = None

    def new_step(self) -> None:
        self.norm = None

    def start(self, per_rank: int) -> None:
        pass

    def route_micro_batch(self, mini: int, mb: MicroBatch | None) -> None:
        pass

    def finish(self, max_norm: float) -> None:
        """Before DeepSpeed's step clips and clears the grads: their norm where it reports none."""
        self._norm_before_step = None
        if self._grad_norm_before_step:
            self._norm_before_step = grad_norm(self.engine.module)

    def stepped(self) -> None:
        norm = self.engine.get_global_grad_norm()
        self.norm = self._norm_before_step if norm is None else float(norm)

    def empty_sums(self, kind: type[Sums]) -> Sums:
        return kind()

    def totals(self, sums: Sums, comm) -> Sums:
        return sums.all_reduce(comm.all_reduce)


def grad_norm(module: torch.nn.Module) -> float:
    """The global L2 norm of the gradients held in `.grad` (fp64)."""
    norms = [
        torch.linalg.vector_norm(p.grad.double()) for p in module.parameters() if p.grad is not None
    ]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def update_kind(config: RunConfig) -> type[Update]:
    """The update a worker of `config` takes: the one reader of `trainer.layout_invariant`."""
    return LayoutFreeUpdate if config.trainer.layout_invariant else PlainUpdate
