"""`DeepSpeedTrainingWorker`: one DeepSpeed data-parallel rank of the RL trainer.

`train_step` reads top to bottom as the step: the ranks agree on their shards
before any forward (`batch_checks`: mini-batches of micro-batches), a no-grad scoring pass
runs where parity or the rollout correction needs pre-update logprobs of later
mini-batches, then for every epoch and mini-batch each micro-batch is scored at the batch's
`logprob_temperature` (`policy.logprob_module.LogprobModule`), checked against the rollout's
logprobs when no update has happened yet (parity), its loss (`step_loss`) backpropagated,
and DeepSpeed steps at the mini-batch's end with every rank applying the update or none
(`step.guard.StepGuard`).
The step's parts: `parity_check` (the parity check and its parity/* metrics), `step_loss`
(a micro-batch's loss and its `LossSums`, the step's metrics), `step_corrections` (rollout
correction's bookkeeping), `router_terms` (MoE); the loop itself, the update and the recovery
from an exception mid-step are PPO's critic's too (`worker.step`).
Setup: `distributed`, `ds_config`, `policy.setup.prepare_policy`; weights and checkpoints:
`weights.checkpoints`; weights straight into the rollout engines over a process group of their
own: `weights.engine_sync` (this class's mixin) over `weights.weight_transport`. The update
(`step.update`): DeepSpeed's own, or under `trainer.layout_invariant` the micro-batches'
per-sequence gradients, loss and update of `layout_free.update`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from rl_engine.config import RunConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.batch_checks import agree_on_batch, plan_scoring, plan_step
from rl_engine.executors.worker.distributed import Collectives, DistEnv, import_deepspeed
from rl_engine.executors.worker.ds_config import build_deepspeed_config, validate_with_deepspeed
from rl_engine.executors.worker.errors import BatchError, ParityError
from rl_engine.executors.worker.layout_free.loss import layout_free_micro_loss
from rl_engine.executors.worker.micro_batches import MicroBatch, MicroSlot
from rl_engine.executors.worker.policy.behaviour import VersionSnapshot
from rl_engine.executors.worker.policy.logprob_module import (
    LogprobModule,
    frozen_copy,
    micro_batch_logprobs,
)
from rl_engine.executors.worker.policy.parity_check import ParityCheck
from rl_engine.executors.worker.policy.router_terms import RouterTerms
from rl_engine.executors.worker.policy.setup import (
    base_record,
    checkpoint_activations,
    prepare_policy,
)
from rl_engine.executors.worker.policy.step_corrections import StepCorrections, scoring_pass
from rl_engine.executors.worker.policy.step_loss import LossSums, micro_loss, step_metrics, summary
from rl_engine.executors.worker.step.loop import StepLoop, build_training_engine
from rl_engine.executors.worker.step.update import update_kind
from rl_engine.executors.worker.weights import checkpoints
from rl_engine.executors.worker.weights.engine_sync import EngineWeightSync
from rl_engine.kernels.devices import check_device
from rl_engine.logprobs.parity import ParitySums

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
        kind = update_kind(config)  # DeepSpeed's own update, or the layout-free one
        self.router = RouterTerms(policy, config, layout_free=kind.layout_free)
        self.module = LogprobModule(policy)
        self.vocab_size = int(self.module.head_parameters()[0].shape[0])  # before ZeRO-3 splits it
        if self.zero_stage == 3:
            for param in self.module.head_parameters():  # used outside the LM head's own forward
                if param is not None:
                    self._deepspeed.zero.register_external_parameter(self.module, param)
        trained = build_training_engine(
            kind,
            self._deepspeed,
            self.module,
            policy,
            config,
            self.ds_config,
            self.comm,
            zero_stage=self.zero_stage,
        )
        self.engine, self.optimizer, self.guard = trained.engine, trained.optimizer, trained.guard
        self.update, self._mid_step = trained.update, trained.mid_step
        self._loop = StepLoop(trained, config)
        self.weight_version = 0
        # asynchronous RL (rollout.max_staleness >= 1): decoupled PPO, and the weights the
        # engines sample with while this rank trains, kept to check their rollouts exactly
        self._decoupled = config.rollout.max_staleness > 0
        self._behaviour: VersionSnapshot | None = None
        self._stale_step = False  # this step's batch was sampled by an older version
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
    # read at each use: `config.parity` may change between steps; a stale batch was checked
    # against its own version's weights before this step (`verify_behaviour`)
    _parity = property(
        lambda self: ParityCheck(
            "off" if self._stale_step else self.config.parity, self.comm, self.update.layout_free
        )
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
        # asynchronous runs: a stale batch's parity was checked against its own version
        stale = batch.weight_version not in (None, self.weight_version)
        self._stale_step = self._decoupled and stale
        if self._decoupled and self.config.parity != "off":  # what the engines sample with now
            self._behaviour = VersionSnapshot.take(self.module.policy, self.weight_version)
        if not update:
            return self._forward_only_step(minis)
        self._ref_logp, self._step_parity = {}, self._parity.empty()
        self.update.new_step()
        self.engine.train()
        with self._mid_step.recoverable():
            # before any update: the pre-update logprobs parity and the rollout correction need
            scored, parity = scoring_pass(minis, self._forward, self._parity, self.config)
            corrections = StepCorrections(
                self.config.algorithm,
                [[None if mb is None else mb.batch for mb in micro] for micro in minis],
                scored,
                self.comm.all_reduce,
                self.comm.all_gather if self.update.layout_free else None,
                decoupled=self._decoupled,
            )
            self.router.start(minis, self.comm.all_reduce)
            loss = functools.partial(self._micro_loss, corrections=corrections)
            sums, outcomes = self._loop.run(minis, loss, LossSums)
        parity = parity.merge(self._step_parity)
        norm = float("nan") if self.update.norm is None else self.update.norm
        return self._finish_step(
            self.update.totals(sums, self.comm), parity, norm, corrections, outcomes
        )

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
        sums = sums.all_reduce(self.comm.all_reduce)
        return self._finish_step(sums, parity, float("nan"), no_corrections, [])

    def _micro_loss(self, slot: MicroSlot, mb: MicroBatch | None, corrections):
        """(loss to backpropagate, its LossSums) of the micro-batch at `slot` (its ParitySums
        into the step's).

        Its forward is checked for parity when it is the step's first of these tokens (the
        first mini-batch in the first epoch: no update has happened yet). An empty
        micro-batch (None: another rank has more) runs a forward on a two-token dummy row and
        backpropagates zero, taking part in every collective of a real one.
        """
        pre_update = slot.epoch == 0 and slot.mini == 0
        with self.router.recording() as routing:  # MoE policies: router logits, experts
            logp = self._forward(mb)  # (b, T-1) fp32
        if pre_update:
            checked = self._parity.check(mb, logp if mb is None else logp.detach())
            self._step_parity = self._step_parity.merge(checked)
        if mb is None:
            return logp.sum() * 0.0, self.update.empty_sums(LossSums)
        key = (slot.mini, slot.micro)
        corrected = corrections.take(key, mb.batch, logp if pre_update else None)
        ref_logp = self._reference_logp(key, mb)
        units = corrections.units[slot.mini]
        scale = self.update.loss_scale
        aux = self.router.loss(routing, mb, scale, slot.mini)  # MoE: the auxiliary loss
        algo = self.config.algorithm
        if scale is None:  # exact per-token weights, per-sequence records
            loss, record = layout_free_micro_loss(algo, mb.batch, logp, ref_logp, units, corrected)
        else:
            loss, record = micro_loss(algo, mb.batch, logp, ref_logp, units, scale, corrected)
        return (loss if aux is None else loss + aux), record

    def _mini_batches(self, batch) -> list[list[MicroBatch]]:
        strict = self.config.parity == "strict"
        return plan_step(
            self.config,
            batch,
            vocab_size=self.vocab_size,
            device=self.device,
            weight_version=self.weight_version if strict else None,
            max_staleness=self.config.rollout.max_staleness,
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

    def _finish_step(
        self,
        sums: LossSums,
        parity: ParitySums,
        norm: float,
        corrections: StepCorrections,
        outcomes: list[str | None],
    ) -> dict[str, float]:
        """The step's metrics over every rank (collective); counts the updates applied."""
        mismatch = self._parity.metrics(parity)
        correction = corrections.metrics(self.comm.all_reduce)
        # an outcome of None: DeepSpeed skipped that update on every rank
        skipped = sum(outcome != "stepped" for outcome in outcomes)
        self.weight_version += len(outcomes) - skipped
        metrics = step_metrics(
            sums,
            mismatch,
            skipped,
            updates=len(outcomes),
            epochs=self.config.trainer.epochs if outcomes else 1,  # a warm-up scores once
            grad_norm=norm,
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

    @torch.no_grad()
    def verify_behaviour(self, batch: TrainBatch) -> dict[str, float]:
        """Parity of a batch the engines sampled while this rank trained (asynchronous RL): its
        rollout logprobs against this rank's logprobs with the weights of the batch's version,
        the snapshot taken before that step's update, checked like a step's (strict: a
        mismatch raises ParityError on every rank). Returns the parity/* metrics (collective),
        or parity/unverified_tokens when no snapshot of that version is held (never exact)."""
        self._mid_step.require_usable()
        check = ParityCheck(self.config.parity, self.comm, self.update.layout_free)
        if not check.active:
            return {}
        held = self._behaviour
        if held is None or held.version != batch.weight_version:
            if check.mode == "strict":
                raise ParityError(
                    f"cannot check a batch of weight_version {batch.weight_version}: this rank "
                    f"holds {'no' if held is None else f'version {held.version}'} snapshot"
                )
            tokens = self.comm.all_reduce(torch.tensor([float(batch.num_tokens)]))
            return {"parity/unverified_tokens": float(tokens[0])}
        micro = agree_on_batch(self.comm, lambda: [self._micro_batches(batch)])[0]
        self.engine.eval()
        sums = check.empty()
        with self._mid_step.recoverable(), held.swapped_in(self.module.policy):
            for mb in micro:  # every rank runs as many forwards (ZeRO-3)
                sums = sums.merge(check.check(mb, self._forward(mb)))
        return {**check.metrics(sums).step_metrics(), "parity/unverified_tokens": 0.0}

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
            layout_free=self.update.layout_free,
        )
        self._log(f"saved checkpoint {tag} to {directory}")

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> None:
        """Restore model, optimizer, step and weight_version (latest tag by default); collective."""
        path, state = checkpoints.load_worker_checkpoint(
            self.engine, Path(directory), tag, self.base, layout_free=self.update.layout_free
        )
        self.weight_version = int(state.get("weight_version", self.global_step))
        self._log(f"loaded {path} (step {self.global_step}, weight_version {self.weight_version})")

    def _log(self, message: str) -> None:
        if self.rank == 0:
            logger.info(message)
