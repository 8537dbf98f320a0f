"""`DeepSpeedTrainingWorker`: one DeepSpeed data-parallel rank of the RL trainer.

`train_step` reads top to bottom as the step: the ranks agree on their shards
before any forward (`batch_checks`: mini-batches of micro-batches), a no-grad scoring pass
runs where parity or the rollout correction needs pre-update logprobs of later
mini-batches, then for every epoch and mini-batch each micro-batch is scored at the batch's
`logprob_temperature` (`policy.LogprobModule`), checked against the rollout's
logprobs when no update has happened yet (parity), its loss (`step_loss`) backpropagated,
and DeepSpeed steps at the mini-batch's end with every rank applying the update or none
(`policy.StepGuard`).
The step's parts: `parity_check` (the parity check and its parity/* metrics), `step_loss`
(a micro-batch's loss and its `LossSums`, the step's metrics), `step_corrections` (rollout
correction's bookkeeping), `router_terms` (MoE), `recovery` (an exception mid-step).
Setup: `distributed`, `ds_config`, `policy.prepare_policy`; weights and checkpoints:
`checkpoints`; weights straight into the rollout engines over a process group of their own:
`engine_sync` (this class's mixin) over `weight_transport`. `trainer.layout_invariant`: the
micro-batches' per-sequence gradients, loss and update of `layout_invariant`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from rl_engine.config import RunConfig
from rl_engine.kernels.devices import check_device
from rl_engine.executors.worker import checkpoints
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.batch_checks import agree_on_batch, plan_scoring, plan_step
from rl_engine.executors.worker.distributed import Collectives, DistEnv, import_deepspeed
from rl_engine.executors.worker.ds_config import build_deepspeed_config, validate_with_deepspeed
from rl_engine.executors.worker.weights.engine_sync import EngineWeightSync
from rl_engine.executors.worker.errors import BatchError, ParityError
from rl_engine.executors.worker.optim.layout_free_adamw import InvariantAdamW
from rl_engine.executors.worker.layout_free.loss import invariant_micro_loss
from rl_engine.executors.worker.layout_free.update import worker_layout_update
from rl_engine.executors.worker.micro_batches import MicroBatch, MicroSlot
from rl_engine.executors.worker.optim.adamw import adamw
from rl_engine.executors.worker.policy.parity_check import ParityCheck
from rl_engine.executors.worker.policy.setup import (
    LogprobModule,
    StepGuard,
    base_record,
    checkpoint_activations,
    frozen_copy,
    micro_batch_logprobs,
    prepare_policy,
)
from rl_engine.executors.worker.step.recovery import MidStepFailures
from rl_engine.executors.worker.policy.router_terms import RouterTerms
from rl_engine.executors.worker.policy.step_corrections import StepCorrections, scoring_pass
from rl_engine.executors.worker.policy.step_loss import (
    LossSums,
    grad_norm,
    micro_loss,
    step_metrics,
    summary,
)
from rl_engine.logprobs.parity import ParitySums
from rl_engine.exact.records import SequenceRecords

__all__ = ["BatchError", "DeepSpeedTrainingWorker", "ParityError", "build_deepspeed_config"]

logger = logging.getLogger(__name__)


class DeepSpeedTrainingWorker(EngineWeightSync):
    """One DeepSpeed rank: teacher-forced logprobs, parity check, GRPO/PPO updates, weight export, checkpoints.

    The policy is `model` when given (patched in place when `config.batch_invariant`), else
    `load_model(config.model, seed=config.seed)`; every rank must start from the same weights.
    The KL reference is a frozen deep copy of it taken before the first step. `train_step`
    takes this rank's shard (`TrainBatch.shard(rank, world_size, mini_batches)`), with exactly
    `config.sequences_per_rank` sequences, as micro-batches padded or packed
    (`micro_batches`: `trainer.packing`, `trainer.max_tokens_per_micro_batch`). `weight_version` counts the
    optimizer updates applied (a skipped update does not count; restored by `load_checkpoint`).
    """

    def __init__(
        self, config: RunConfig, *, device: str | torch.device, model: nn.Module | None = None
    ):
        if not isinstance(config, RunConfig):
            raise TypeError(f"config must be a RunConfig, got {type(config).__name__}")
        self.config, self.env = config, DistEnv.from_environ()
        self.device = check_device(device, local_rank=self.env.local_rank)
        self.ds_config = build_deepspeed_config(config, self.env.world_size)
        self._deepspeed, backend = import_deepspeed(self.device)
        self._deepspeed.init_distributed(dist_backend=backend)
        validate_with_deepspeed(self.ds_config)
        self.comm = Collectives(self.env.rank, self.env.world_size, self.device)
        policy = prepare_policy(model, config, self.device)
        self.base = base_record(policy, config)  # before ZeRO-3 partitions the base
        self.reference = frozen_copy(policy) if config.algorithm.kl_coef > 0 else None
        checkpoint_activations(policy, config)
        self.router = RouterTerms(policy, config)
        self.module = LogprobModule(policy)
        self.vocab_size = int(self.module.head_parameters()[0].shape[0])  # before ZeRO-3 splits it
        if self.zero_stage == 3:
            for param in self.module.head_parameters():  # used outside the LM head's own forward
                if param is not None:
                    self._deepspeed.zero.register_external_parameter(self.module, param)
        trainer = config.trainer
        trainable = [p for p in self.module.parameters() if p.requires_grad]  # LoRA: adapters
        make = InvariantAdamW if trainer.layout_invariant else adamw
        optimizer = make(trainable, lr=trainer.lr, weight_decay=trainer.weight_decay)
        self.guard = StepGuard(optimizer, self.comm)
        self.engine, self.optimizer, _, _ = self._deepspeed.initialize(
            model=self.module, optimizer=optimizer, config=self.ds_config, dist_init_required=False
        )
        # trainer.layout_invariant: the update no layout enters (None otherwise)
        self.layout = worker_layout_update(self, policy, optimizer)
        self._mid_step = MidStepFailures(self.engine, zero3=self.zero_stage == 3)
        self.weight_version = 0
        self._weight_sync = None  # (manifest, senders, group) once connect_weight_sync ran
        self._log(
            f"DeepSpeed worker ready: {self.world_size} rank(s), ZeRO-{self.zero_stage}, "
            f"{config.dtype}, batch_invariant={config.batch_invariant}, parity={config.parity}, "
            f"device={self.device}"
        )

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    zero_stage = property(lambda self: int(self.ds_config["zero_optimization"]["stage"]))
    global_step = property(
        lambda self: int(self.engine.global_steps), doc="optimizer steps taken, skipped or not"
    )
    # read at each use: `config.parity` may change between steps
    _parity = property(
        lambda self: ParityCheck(self.config.parity, self.comm, self.layout is not None)
    )

    # -------------------------------------------------------------- the step

    def train_step(self, batch: TrainBatch, *, update: bool = True) -> dict[str, float]:
        """One RL step on this rank's shard: `trainer.epochs` passes over its mini-batches, one
        optimizer step each; returns metrics all-reduced over ranks. `update=False` (PPO's
        critic warm-up, `critic.warmup_steps`): no optimizer step, only a no-grad forward of
        every sequence for parity and entropy (`updates` 0, loss terms 0).

        Metrics: loss (policy loss + kl_coef x kl), policy_loss, clip_fraction, kl (k3 to the
        reference policy, 0 without one), entropy (an ESTIMATE: minus the mean logprob of the
        sampled completion tokens), tokens, grad_norm, lr, step, weight_version,
        skipped_update (how many updates a non-finite loss or gradient on any rank skipped,
        on all ranks; then skip_reason says why), updates (optimizer steps taken or skipped)
        and, unless parity is 'off', parity/{exact_match_fraction, max_abs_diff,
        mean_abs_diff, kl, num_tokens}: the trainer's logprobs of the pre-update policy vs the
        rollout's (`trainer.parity_scope`: the first mini-batch's, or every sequence);
        correction/{ratio_mean, ratio_min, ratio_max, truncated_fraction, masked_fraction,
        masked_sequence_fraction, k3_kl, trainer_ppl, rollout_ppl}: the importance ratio
        trainer / rollout and what `algorithm.rollout_correction` truncated or dropped;
        for a mixture-of-experts policy router/{aux_loss, max_load_share,
        max_load_share_worst_layer, load_entropy} (rl_engine/executors/worker/policy/router_terms.py).
        With several updates, loss, policy_loss, kl and router/aux_loss are means over the
        updates, clip_fraction and entropy over every training forward's tokens, and grad_norm
        is the last update's.

        A bad shard on any rank: BatchError on every rank, before any forward. parity 'strict':
        a mismatch in any checked micro-batch (checked before its backward) raises ParityError
        on every rank, no update taken. After an exception that follows a backward, the worker
        refuses further steps (gradients are left inside DeepSpeed).
        """
        self._mid_step.require_usable()
        minis = agree_on_batch(self.comm, lambda: self._mini_batches(batch))
        if not update:
            return self._forward_only_step(minis)
        # engine.backward divides by DeepSpeed's gradient_accumulation_steps: undone here
        scale = self.engine.gradient_accumulation_steps() * self.world_size
        sums, parity, norm, outcomes = self._empty_sums(), self._parity.empty(), None, []
        self._ref_logp = {}
        if self.layout is not None:
            self.layout.new_step()
        self.engine.train()
        with self._mid_step.recoverable():
            # before any update: the pre-update logprobs parity and the rollout correction need
            scored, parity = scoring_pass(minis, self._forward, self._parity, self.config)
            corrections = StepCorrections(
                self.config.algorithm,
                [[None if mb is None else mb.batch for mb in micro] for micro in minis],
                scored,
                self.comm.all_reduce,
                self.comm.all_gather if self.layout is not None else None,
            )
            self.router.start(minis, self.comm.all_reduce)
            for epoch in range(self.config.trainer.epochs):
                for j, micro in enumerate(minis):
                    record, norm = self._update(epoch, j, micro, corrections, scale, norm)
                    sums, parity = sums.merge(record[0]), parity.merge(record[1])
                    outcomes.append(self.guard.outcome)
        return self._finish_step(sums, parity, norm, corrections, outcomes)

    def _forward_only_step(self, minis) -> dict[str, float]:
        """A step without an update: every sequence scored once, no grad, parity checked."""
        sums, parity = LossSums(), self._parity.empty()
        self.engine.eval()
        self.router.start(minis, self.comm.all_reduce)  # MoE: zero counts (no aux loss here)
        with torch.no_grad(), self._mid_step.recoverable():
            for micro in minis:
                for mb in micro:
                    logp = self._forward(mb)  # every rank runs as many forwards (ZeRO-3)
                    parity = parity.merge(self._parity.check(mb, logp))
                    if mb is not None:
                        mask = mb.batch.response_mask
                        neg_logp = -float(logp[mask].double().sum())
                        sums = sums.merge(LossSums(neg_logp=neg_logp, tokens=float(mask.sum())))
        no_corrections = StepCorrections(self.config.algorithm, [], {}, self.comm.all_reduce)
        return self._finish_step(sums, parity, float("nan"), no_corrections, [])

    def _update(self, epoch: int, j: int, micro, corrections, scale: int, norm):
        """One optimizer step on mini-batch `j`: its micro-batches' forwards and backwards, the
        accumulation boundary on its last one. Returns ((LossSums, ParitySums), grad norm)."""
        sums, parity = self._empty_sums(), self._parity.empty()
        last = len(micro) - 1
        if self.layout is not None:
            self.layout.start(self.config.mini_batch_per_rank)
        for i, mb in enumerate(micro):
            # Micro-batch counts vary per mini-batch: DeepSpeed reduces gradients and may update
            # after its last one only, on every rank at once (the count is agreed).
            self.engine.set_gradient_accumulation_boundary(i == last)
            loss, record, mb_parity = self._micro_loss(
                MicroSlot(epoch, j, i), mb, corrections, scale
            )
            sums, parity = sums.merge(record), parity.merge(mb_parity)
            self._mid_step.backward_taken = True
            self.engine.backward(loss)
            if i == last and self.layout is not None:  # the whole gradients into DeepSpeed
                norm = self.layout.finish(self.config.trainer.grad_clip)
            elif i == last:  # the accumulation boundary: step() may update
                norm = self._stage0_grad_norm()  # before step() clips and clears the grads
                self.guard.arm(force_skip=not sums.finite())
            self.engine.step()
            if i == last and self.layout is not None:
                self.layout.stepped()
        return (sums, parity), norm

    def _micro_loss(self, slot: MicroSlot, mb: MicroBatch | None, corrections, scale: int):
        """(loss to backpropagate, LossSums, ParitySums) of the micro-batch at `slot`.

        Its forward is checked for parity when it is the step's first of these tokens (the
        first mini-batch in the first epoch: no update has happened yet). An empty
        micro-batch (None: another rank has more) runs a forward on a two-token dummy row and
        backpropagates zero, taking part in every collective of a real one.
        """
        pre_update = slot.epoch == 0 and slot.mini == 0
        self._route_forward(slot, mb)
        with self.router.recording() as routing:  # MoE policies: router logits, experts
            logp = self._forward(mb)  # (b, T-1) fp32
        if mb is None:
            parity = self._parity.check(None, logp) if pre_update else self._parity.empty()
            return logp.sum() * 0.0, self._empty_sums(), parity
        parity = self._parity.check(mb, logp.detach()) if pre_update else self._parity.empty()
        key = (slot.mini, slot.micro)
        corrected = corrections.take(key, mb.batch, logp if pre_update else None)
        ref_logp = self._reference_logp(key, mb)
        units = corrections.units[slot.mini]
        aux = self.router.loss(routing, mb, scale, slot.mini)  # MoE: the auxiliary loss
        if self.layout is not None:
            loss, records = invariant_micro_loss(
                self.config.algorithm, mb.batch, logp, ref_logp, units, corrected
            )
            return (loss if aux is None else loss + aux), records, parity
        loss, record = micro_loss(
            self.config.algorithm,
            mb.batch,
            logp,
            ref_logp,
            units,
            scale,
            corrected,
        )
        return (loss if aux is None else loss + aux), record, parity

    def _route_forward(self, slot: MicroSlot, mb: MicroBatch | None) -> None:
        """Layout-invariant steps: point the gradient route at `mb`'s sequences."""
        if self.layout is not None:
            self.layout.route_micro_batch(slot.mini, mb)

    def _empty_sums(self) -> LossSums | SequenceRecords:
        """The start of a step's loss sums: per-sequence records under layout_invariant."""
        return LossSums() if self.layout is None else SequenceRecords(LossSums)

    def _mini_batches(self, batch) -> list[list[MicroBatch]]:
        strict = self.config.parity == "strict"
        return plan_step(
            self.config,
            batch,
            vocab_size=self.vocab_size,
            device=self.device,
            weight_version=self.weight_version if strict else None,
        )

    def _micro_batches(self, batch) -> list[MicroBatch]:
        return plan_scoring(self.config, batch, vocab_size=self.vocab_size, device=self.device)

    def _forward(self, mb: MicroBatch | None, module=None) -> torch.Tensor:
        """(b, T-1) fp32 logprobs of `mb` by the engine (or `module`): `micro_batch_logprobs`."""
        return micro_batch_logprobs(self.engine if module is None else module, mb, self.device)

    def _reference_logp(self, key: tuple[int, int], mb: MicroBatch) -> torch.Tensor | None:
        """The frozen reference's logprobs of micro-batch `key`, computed once per step."""
        if self.reference is None:
            return None
        if key not in self._ref_logp:
            with torch.no_grad():
                self._ref_logp[key] = self._forward(mb, self.reference)
        return self._ref_logp[key]

    def _stage0_grad_norm(self) -> float | None:
        """Plain ZeRO-0 fp32 keeps the averaged grads in .grad and DeepSpeed does not report their norm."""
        plain = self.zero_stage == 0 and self.config.dtype == "float32"
        if not plain or not self.engine.is_gradient_accumulation_boundary():
            return None
        return grad_norm(self.module)

    def _finish_step(
        self,
        sums: LossSums,
        parity: ParitySums,
        stage0_norm: float | None,
        corrections: StepCorrections,
        outcomes: list[str | None],
    ) -> dict[str, float]:
        """The step's metrics over every rank (collective); counts the updates applied."""
        if isinstance(sums, SequenceRecords):  # exact sums over every rank's sequences
            sums, stage0_norm = sums.total(self.comm.all_gather), self.layout.norm
        else:
            sums = sums.all_reduce(self.comm.all_reduce)
        mismatch = self._parity.metrics(parity)
        correction = corrections.metrics(self.comm.all_reduce)
        # an outcome of None: DeepSpeed skipped that update on every rank
        skipped = sum(outcome != "stepped" for outcome in outcomes)
        self.weight_version += len(outcomes) - skipped
        norm = self.engine.get_global_grad_norm() if outcomes and not self.layout else None
        norm = stage0_norm if norm is None else norm
        metrics = step_metrics(
            sums,
            mismatch,
            skipped,
            updates=len(outcomes),
            epochs=self.config.trainer.epochs if outcomes else 1,  # a warm-up scores once
            grad_norm=float("nan") if norm is None else float(norm),
            lr=float(self.engine.get_lr()[0]),
            step=self.global_step,
            weight_version=self.weight_version,
            **correction,
            **self.router.metrics(self.comm, max(len(outcomes), 1)),
        )
        self._log(summary(metrics))
        return metrics

    # -------------------------------------------------------------- logprobs, weights, checkpoints

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """fp32 (B, T-1) logprobs of the current policy at the scored (response_mask) positions, 0 elsewhere.

        Runs in micro-batches through the DeepSpeed engine; under ZeRO-3 that is collective
        (every rank calls it with the same number of micro-batches).
        """
        self._mid_step.require_usable()
        micro = agree_on_batch(self.comm, lambda: [self._micro_batches(batch)])[0]
        self.engine.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        with self._mid_step.recoverable():
            for mb in micro:
                logp = self._forward(mb).cpu()  # every rank runs as many forwards (ZeRO-3)
                if mb is not None:
                    out[list(mb.sequences), : logp.shape[1]] = logp
        return out

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's full state dict under the HF model's own names (what RolloutEngine.load_weights takes).

        Collective under ZeRO-3 (every rank must call it); rank 0 gets the dict, others None.
        Tensors are CPU copies in the trained dtype; tied names share one tensor. ZeRO-3 ranks
        gather one bucket (`trainer.weight_sync_bucket_mb`) at a time.
        """
        return checkpoints.export_state_dict(
            self.module.policy,
            zero3=self.zero_stage == 3,
            rank=self.rank,
            deepspeed=self._deepspeed,
            bucket_bytes=self.config.trainer.weight_sync_bucket_bytes,
        )

    def save_weights(self, path: str | Path) -> Path | None:
        """The policy as a safetensors file at `path`, written by rank 0 (collective under ZeRO-3,
        one gathered bucket at a time); `weights_file.read_weights_file` reads it back."""
        return checkpoints.save_weights_file(
            self.module.policy,
            Path(path),
            zero3=self.zero_stage == 3,
            rank=self.rank,
            deepspeed=self._deepspeed,
            bucket_bytes=self.config.trainer.weight_sync_bucket_bytes,
        )

    def save_checkpoint(self, directory: str | Path, tag: str | None = None) -> None:
        """DeepSpeed checkpoint (model, optimizer, step, weight_version) under `directory`; collective.
        Under trainer.layout_invariant: the layout-free state (per parameter: fp32 master, AdamW
        moments), which any layout resumes.

        Atomic: an interrupted save leaves the previous checkpoint and `latest` untouched.
        """
        tag = tag or f"step{self.global_step}"
        state = {"rl_engine_step": self.global_step, "weight_version": self.weight_version}
        checkpoints.save_worker_checkpoint(
            self.engine,
            self.comm,
            Path(directory),
            tag,
            state,
            self.base,
            layout_free=self.layout is not None,
        )
        self._log(f"saved checkpoint {tag} to {directory}")

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> None:
        """Restore model, optimizer, step and weight_version (latest tag by default); collective."""
        path, state = checkpoints.load_worker_checkpoint(
            self.engine, Path(directory), tag, self.base, layout_free=self.layout is not None
        )
        self.weight_version = int(state.get("weight_version", self.global_step))
        self._log(f"loaded {path} (step {self.global_step}, weight_version {self.weight_version})")

    def _log(self, message: str) -> None:
        if self.rank == 0:
            logger.info(message)
