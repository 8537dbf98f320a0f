"""The step loop the policy worker and PPO's critic share, and the engine it drives.

Per step: for every epoch and mini-batch, each micro-batch's forward and loss (the worker's
`MicroLoss`) and DeepSpeed's backward; at the mini-batch's last micro-batch the update's
`finish` (its gradients ready), the all-or-none guard armed, and DeepSpeed's step. What a
plain or a layout-free update does differently is the `Update`'s (`step.update`), chosen
once (`step.update.update_kind`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_engine.exact.records import SequenceRecords, Sums
from rl_engine.executors.worker.deepspeed_muon import skip_muon_probe
from rl_engine.executors.worker.micro_batches import MicroBatch, MicroSlot
from rl_engine.executors.worker.step.guard import StepGuard
from rl_engine.executors.worker.step.recovery import MidStepFailures
from rl_engine.executors.worker.step.update import Update

MicroLoss = Callable[[MicroSlot, MicroBatch | None], tuple[torch.Tensor, Sums | SequenceRecords]]
"""(slot, micro-batch or None) -> (loss to backpropagate, its records): a worker's loss."""


@dataclass
class TrainingEngine:
    """DeepSpeed's engine around a worker's module, with what its step needs."""

    engine: object
    optimizer: object  # DeepSpeed's optimizer (its wrapper under ZeRO)
    guard: StepGuard
    update: Update
    mid_step: MidStepFailures


def build_training_engine(
    kind: type[Update], deepspeed, module, route_model, config, ds_config, comm, *, zero_stage
):
    """`deepspeed.initialize` of `module` (its trainable parameters under the update's
    optimizer, guarded), and the update of `kind` (`update_kind`) bound to it; `route_model`:
    the patched model whose ops send a layout-free update's per-sequence partials."""
    trainer = config.trainer
    trainable = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = kind.make_optimizer(trainable, lr=trainer.lr, weight_decay=trainer.weight_decay)
    guard = StepGuard(optimizer, comm)
    skip_muon_probe()  # ZeRO asks whether `optimizer` is Muon: 1.3 s a rank to import it
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=ds_config, dist_init_required=False
    )
    update = kind(
        route_model, engine, optimizer, rank=comm.rank, world=comm.world_size, zero_stage=zero_stage
    )
    mid_step = MidStepFailures(engine, zero3=zero_stage == 3)
    return TrainingEngine(engine, ds_optimizer, guard, update, mid_step)


class StepLoop:
    """Runs a step's updates; callers hold `mid_step.recoverable()` around `run`."""

    def __init__(self, trained: TrainingEngine, config):
        self.engine, self.update = trained.engine, trained.update
        self.guard, self.mid_step = trained.guard, trained.mid_step
        self.epochs = config.trainer.epochs
        self.per_rank = config.mini_batch_per_rank
        self.grad_clip = config.trainer.grad_clip

    def run(self, minis: list[list[MicroBatch | None]], micro_loss: MicroLoss, kind: type[Sums]):
        """`trainer.epochs` passes over the mini-batches, one optimizer step each: returns (their
        records, each update's outcome: 'stepped', 'skipped', or None when DeepSpeed skipped)."""
        sums, outcomes = self.update.empty_sums(kind), []
        for epoch in range(self.epochs):
            for j, micro in enumerate(minis):
                sums = sums.merge(self._mini_batch(epoch, j, micro, micro_loss, kind))
                outcomes.append(self.guard.outcome)
        return sums, outcomes

    def _mini_batch(self, epoch: int, j: int, micro, micro_loss: MicroLoss, kind: type[Sums]):
        """One optimizer step on mini-batch `j`: its micro-batches' forwards and backwards, the
        accumulation boundary on its last one."""
        sums, last = self.update.empty_sums(kind), len(micro) - 1
        self.update.start(self.per_rank)
        for i, mb in enumerate(micro):
            # Micro-batch counts vary per mini-batch: DeepSpeed reduces gradients and may update
            # after its last one only, on every rank at once (the count is agreed).
            self.engine.set_gradient_accumulation_boundary(i == last)
            self.update.route_micro_batch(j, mb)
            loss, record = micro_loss(MicroSlot(epoch, j, i), mb)
            sums = sums.merge(record)
            self.mid_step.backward_taken = True
            self.engine.backward(loss)
            if i == last:  # the accumulation boundary: step() may update
                self.update.finish(self.grad_clip)
                self.guard.arm(force_skip=not sums.finite())
            self.engine.step()
            if i == last:
                self.update.stepped()
        return sums
