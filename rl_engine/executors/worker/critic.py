"""`CriticWorker`: one DeepSpeed data-parallel rank of PPO's value model (no Ray here).

The critic has its own ranks and its own torch.distributed world (`critic.num_ranks`,
`critic.zero_stage`, `critic.lr`; everything else of the trainer section is shared:
micro-batches, packing, token budget, mini-batches, epochs, dtype, grad clip). Its model
is `value_model.ValueModule`: the policy's backbone, patched with `apply_batch_invariant`
when `batch_invariant` (the same kernels as the policy, so a sequence's values do not
depend on the micro-batch layout, the packing or the other sequences of the batch), and
a scalar value head.

With `lora.rank` > 0 the backbone is frozen and carries an adapter of its own (the `lora:`
section's rank, alpha and targets; PEFT's initialisation drawn from `critic_adapter_seed`, a
stream apart from the policy's seed): the optimizer holds that adapter and the value head
alone, and checkpoints hold them, with the base's spec and content hash checked on resume as
the policy's are. With `critic.model` null the backbone is the policy's base model, so the
two adapters share one frozen base (each process holds its own copy of it).

Per RL step the job calls `values(shard)` (no grad: the rollout-time values V_old that
GAE reads) and then `train_step(shard, returns, old_values)`: for every epoch and
mini-batch, the clipped value loss (`rl_engine.algorithms.clipped_value_loss`, a token
mean over the mini-batch's completion tokens on all ranks) backpropagated per
micro-batch, one optimizer step per mini-batch. Batch checks, micro-batch planning,
the all-or-none update guard and checkpoints are the policy worker's own helpers.

`trainer.layout_invariant`: the update the policy worker takes in that mode
(`layout_invariant.LayoutInvariantUpdate` bound to the value model, the value head's partials
included; the loss of `value_loss.value_micro_loss` weighted per token by exact global
counts; `InvariantAdamW`; per-sequence metric records) and the layout-free checkpoint, so the
critic's weights, optimizer state and metrics do not depend on `critic.num_ranks`,
`critic.zero_stage`, the micro-batching or packing, and a run resumes on another critic layout.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from rl_engine.algorithms import aggregation_units
from rl_engine.config import RunConfig
from rl_engine.kernels.devices import check_device
from rl_engine.executors.worker import checkpoints
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.batch_checks import agree_on_batch, plan_scoring, plan_step
from rl_engine.executors.worker.distributed import Collectives, DistEnv, import_deepspeed
from rl_engine.executors.worker.ds_config import build_deepspeed_config, validate_with_deepspeed
from rl_engine.executors.worker.errors import BatchError
from rl_engine.executors.worker.optim.layout_free_adamw import InvariantAdamW
from rl_engine.executors.worker.layout_free.update import worker_layout_update
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.optim.adamw import adamw
from rl_engine.executors.worker.policy.setup import (
    StepGuard,
    base_record,
    checkpoint_activations,
    prepare_policy,
)
from rl_engine.executors.worker.critic.value_loss import ValueLossSums, value_micro_loss
from rl_engine.executors.worker.critic.value_model import ValueModule
from rl_engine.exact.records import SequenceRecords

logger = logging.getLogger(__name__)


def critic_adapter_seed(seed: int) -> int:
    """The seed of the critic's LoRA adapter: a 63-bit hash of (seed, 'critic'), stable across
    Python versions, so the critic's A never repeats the policy's (drawn from `seed` itself)."""
    digest = hashlib.blake2b(f"critic_adapter/{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class CriticWorker:
    """One critic rank: values of a batch, clipped value-loss updates, checkpoints.

    `config` is the run's config; the worker reads it through `config.critic_view()`. The
    backbone is `model` when given (patched in place when `batch_invariant`), else
    `load_model(critic.model or model, seed=seed)`: by default the policy's own weights.
    Every rank must start from the same weights.
    """

    def __init__(
        self, config: RunConfig, *, device: str | torch.device, model: nn.Module | None = None
    ):
        if not isinstance(config, RunConfig):
            raise TypeError(f"config must be a RunConfig, got {type(config).__name__}")
        self.config, self.env = config.critic_view(), DistEnv.from_environ()
        self.value_clip = config.critic.value_clip
        self.device = check_device(device, local_rank=self.env.local_rank)
        self.ds_config = build_deepspeed_config(self.config, self.env.world_size)
        self._deepspeed, backend = import_deepspeed(self.device)
        self._deepspeed.init_distributed(dist_backend=backend)
        validate_with_deepspeed(self.ds_config)
        self.comm = Collectives(self.env.rank, self.env.world_size, self.device)
        adapter_seed = critic_adapter_seed(config.seed)
        backbone = prepare_policy(model, self.config, self.device, adapter_seed=adapter_seed)
        self.base = base_record(backbone, self.config)  # before ZeRO-3 partitions the base
        checkpoint_activations(backbone, self.config)
        self.vocab_size = int(backbone.get_input_embeddings().weight.shape[0])
        self.module = ValueModule(backbone)
        trainer = self.config.trainer
        trainable = [p for p in self.module.parameters() if p.requires_grad]  # LoRA: adapter, head
        make = InvariantAdamW if trainer.layout_invariant else adamw
        optimizer = make(trainable, lr=trainer.lr, weight_decay=trainer.weight_decay)
        self.guard = StepGuard(optimizer, self.comm)
        self.engine, self.optimizer, _, _ = self._deepspeed.initialize(
            model=self.module, optimizer=optimizer, config=self.ds_config, dist_init_required=False
        )
        # trainer.layout_invariant: the policy's layout-free update, on the value model
        self.layout = worker_layout_update(self, self.module, optimizer)
        self.updates = 0
        if self.rank == 0:
            logger.info(
                "critic worker ready: %d rank(s), ZeRO-%d, %s, batch_invariant=%s",
                self.world_size,
                self.zero_stage,
                self.config.dtype,
                self.config.batch_invariant,
            )

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    zero_stage = property(lambda self: int(self.ds_config["zero_optimization"]["stage"]))

    # -------------------------------------------------------------- values

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """fp32 (B, T-1) values of the current critic, aligned with `batch.response_mask`, 0 off
        it. Any number of sequences; collective under ZeRO-3 (every rank calls it)."""
        micro = agree_on_batch(
            self.comm,
            lambda: [
                plan_scoring(self.config, batch, vocab_size=self.vocab_size, device=self.device)
            ],
        )[0]
        self.engine.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        for mb in micro:
            values = self._forward(mb)  # every rank runs as many forwards (ZeRO-3)
            if mb is not None:
                masked = torch.where(mb.batch.response_mask, values, 0.0).cpu()
                out[list(mb.sequences), : masked.shape[1]] = masked
        return out

    # -------------------------------------------------------------- the update

    def train_step(
        self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor
    ) -> dict[str, float]:
        """`trainer.epochs` passes over this rank's shard (`TrainBatch.shard(rank, world_size,
        mini_batches)`, exactly `sequences_per_rank` sequences), one optimizer step per
        mini-batch. `returns` and `old_values` are (B, T-1) fp32 aligned with the shard's
        response_mask (GAE's advantages + V_old, and V_old).

        Returns metrics all-reduced over ranks: critic/value_loss (the mean over updates of
        each update's token-mean clipped loss), critic/clip_fraction (tokens whose clipped
        error was the larger, over every training forward), critic/updates,
        critic/skipped_update (a non-finite loss or gradient on any rank skips that update
        on every rank).
        """
        self._check_targets(batch, returns, old_values)
        minis = agree_on_batch(self.comm, lambda: self._mini_batches(batch))
        units = self._mini_batch_tokens(minis)
        # engine.backward divides by DeepSpeed's gradient_accumulation_steps: undone here
        scale = self.engine.gradient_accumulation_steps() * self.world_size
        if self.layout is not None:
            scale = None  # the layout-free loss: each token weighted by exact global counts
            self.layout.new_step()
        sums, outcomes = self._empty_sums(), []
        self.engine.train()
        for _ in range(self.config.trainer.epochs):
            for j, micro in enumerate(minis):
                sums = sums.merge(self._update(j, micro, (returns, old_values), units[j], scale))
                outcomes.append(self.guard.outcome)
        if isinstance(sums, SequenceRecords):  # exact sums over every rank's sequences
            sums = sums.total(self.comm.all_gather)
        else:
            sums = sums.all_reduce(self.comm.all_reduce)
        skipped = sum(outcome != "stepped" for outcome in outcomes)
        self.updates += len(outcomes) - skipped
        return {
            "critic/value_loss": sums.loss / len(outcomes),
            "critic/clip_fraction": sums.clipped / max(sums.tokens, 1.0),
            "critic/updates": len(outcomes),
            "critic/skipped_update": skipped,
        }

    def _update(self, j: int, micro, targets, units: float, scale: int | None):
        """One optimizer step on mini-batch `j` (its micro-batches' forwards and backwards, the
        accumulation boundary on the last); returns its loss records. `targets`: (returns,
        old_values) of the shard."""
        sums, last = self._empty_sums(), len(micro) - 1
        if self.layout is not None:
            self.layout.start(self.config.mini_batch_per_rank)
        for i, mb in enumerate(micro):
            self.engine.set_gradient_accumulation_boundary(i == last)
            if self.layout is not None:
                self.layout.route_micro_batch(j, mb)
            loss, record = self._micro_loss(mb, *targets, units, scale)
            sums = sums.merge(record)
            self.engine.backward(loss)
            if i == last and self.layout is not None:  # the whole gradients into DeepSpeed
                self.layout.finish(self.config.trainer.grad_clip)
            if i == last:
                self.guard.arm(force_skip=not sums.finite())
            self.engine.step()
            if i == last and self.layout is not None:
                self.layout.stepped()
        return sums

    def _micro_loss(self, mb: MicroBatch | None, returns, old_values, units: float, scale):
        """(loss to backpropagate, its records) of one micro-batch (`value_loss`). An empty
        micro-batch (None: another rank has more) runs a dummy forward and backpropagates
        zero."""
        values = self._forward(mb)
        if mb is None:
            return values.sum() * 0.0, self._empty_sums()
        mask = mb.batch.response_mask
        rows, width = list(mb.sequences), mask.shape[1]
        target = returns[rows, :width].to(values.device)
        old = old_values[rows, :width].to(values.device)
        return value_micro_loss(
            values, target, old, mask, clip=self.value_clip, units=units, scale=scale
        )

    def _empty_sums(self) -> ValueLossSums | SequenceRecords:
        """The start of a step's loss sums: per-sequence records under layout_invariant."""
        return ValueLossSums() if self.layout is None else SequenceRecords(ValueLossSums)

    def _mini_batch_tokens(self, minis) -> list[float]:
        """Each mini-batch's completion tokens over every rank: its token-mean's denominator."""
        local = [
            sum(aggregation_units(mb.batch.response_mask, "token-mean") for mb in m if mb)
            for m in minis
        ]
        total = self.comm.all_reduce(torch.tensor(local, dtype=torch.float64))
        return [max(float(t), 1.0) for t in total]

    def _mini_batches(self, batch) -> list[list[MicroBatch]]:
        return plan_step(self.config, batch, vocab_size=self.vocab_size, device=self.device)

    @staticmethod
    def _check_targets(batch: TrainBatch, returns, old_values) -> None:
        """returns and old_values: finite fp32 (B, T-1) like the shard's response_mask."""
        if not isinstance(batch, TrainBatch):
            raise BatchError(f"batch must be a TrainBatch, got {type(batch).__name__}")
        shape = tuple(batch.response_mask.shape)
        for name, x in (("returns", returns), ("old_values", old_values)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise BatchError(f"{name} must be (B, T-1) = {shape} like response_mask, got {got}")
            if not bool(torch.isfinite(x[batch.response_mask]).all()):
                raise BatchError(f"{name} must be finite on the completion tokens")

    def _forward(self, mb: MicroBatch | None) -> torch.Tensor:
        """(b, T-1) fp32 values of the padded view (packed micro-batches run packed). None: the
        empty micro-batch's forward on a two-token dummy row ((1, 1), on the graph)."""
        if mb is None:
            ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
            return self.engine(ids, torch.ones_like(ids))
        b = mb.batch
        if mb.packed is None:
            return self.engine(b.input_ids, b.attention_mask)
        p = mb.packed
        return mb.logprobs_view(self.engine(p.input_ids, None, p.positions, p.segments))

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str | Path, tag: str = "state") -> None:
        """DeepSpeed checkpoint (value model, optimizer, step) under `directory`; collective,
        atomic. LoRA: the adapter and the value head, and the base's record instead of it.
        Under trainer.layout_invariant: the layout-free state, which any critic layout resumes."""
        state = {"critic_updates": self.updates, "rl_engine_step": int(self.engine.global_steps)}
        checkpoints.save_worker_checkpoint(
            self.engine,
            self.comm,
            Path(directory),
            tag,
            state,
            self.base,
            layout_free=self.layout is not None,
        )

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> None:
        """Restore what `save_checkpoint` wrote (latest tag by default); collective. LoRA: a
        checkpoint of another base raises before anything is loaded."""
        _, state = checkpoints.load_worker_checkpoint(
            self.engine, Path(directory), tag, self.base, layout_free=self.layout is not None
        )
        self.updates = int(state.get("critic_updates", 0))
