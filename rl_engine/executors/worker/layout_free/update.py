"""The worker's layout-free update (`trainer.layout_invariant: true`, `step.update.Update`): one optimizer step
whose bits do not depend on the ranks, ZeRO stage, micro-batching or packing.

Per mini-batch of M sequences (canonical order: the batch's rows; rank r holds
[r M / W, (r + 1) M / W), `TrainBatch.shard`), on every rank:

1. every micro-batch is a run of consecutive sequences (`plan_micro_batches(consecutive=True)`);
   before its forward the patched model's `GradientRoute` gets the micro-batch's spans with
   the sequences' canonical indices, so each op's backward sends every sequence's partial of
   each parameter to this mini-batch's `SequenceGradients` (kernels/common/sequence_spans.py);
2. its loss is `layout_free_micro_loss`: each token weighted by its sequence and the mini-batch's
   exact counts alone;
3. after the last micro-batch, one parameter at a time: its whole gradient (`whole_gradient`:
   the canonical tree over all ranks' covers, the same bits on every rank), its partials
   released, its terms of the clip's norm (`row_square_sums`), its write into DeepSpeed's
   partition; then the norm (`global_norm`'s exact sum of those terms) arms the optimizer
   with the clip coefficient (`LayoutFreeAdamW`), and DeepSpeed steps as usual (its own reduction carried zeros,
   or nothing). A parameter at a time: the model's gradient is never held twice.

A parameter that no op sent partials for fails the step (`LayoutFreeError`): its
gradient would otherwise be DeepSpeed's, whose sums follow the layout.

`timings` (always on: a perf_counter per part, reset by `new_step`) are the seconds of each
part of the step's updates, summed over its mini-batches: forward_backward (from `start` to
`finish`: the micro-batches' forwards, losses and backwards, the partials into the sink
included), whole_gradients, norm, inject (the writes into DeepSpeed's partitions) and
deepspeed_step (`stepped`: after DeepSpeed's step). `held` counts the sink's partial-sized
tensors (`SequenceGradients.held`, `peak_held`) and the bytes held at the end of the last
backward; `rl-engine bench train --case layout` prints both.
"""

from __future__ import annotations

import math
import time

from rl_engine.base.slab_arena import SLAB_BYTES
from rl_engine.exact.canonical_sum import value_tensors
from rl_engine.exact.float_sums import exact_sum
from rl_engine.exact.records import SequenceRecords, Sums
from rl_engine.exact.sequence_gradients import SequenceGradients
from rl_engine.executors.worker.layout_free.grads import (
    clip_coefficient,
    inject_gradient,
    row_square_sums,
    whole_gradient,
)
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.optim.layout_free_adamw import LayoutFreeAdamW
from rl_engine.kernels import SequenceSpans
from rl_engine.patching.gradient_route import GradientRoute, bind_gradient_route

PARTS = ("forward_backward", "whole_gradients", "norm", "inject", "deepspeed_step")


class LayoutFreeError(RuntimeError):
    """A layout-free step cannot keep its bits (names the parameter or the cause)."""


class DeepSpeedSink(SequenceGradients):
    """The mini-batch's SequenceGradients. `placeholder_grads`: the ops' backward also returns a
    zero gradient for each parameter, because ZeRO-1/2 only hold gradient partitions to write
    into after a backward that produced some. ZeRO-3's partitions are views of one flat buffer
    that always exist: there every parameter is marked `ds_grad_is_ready = False` (DeepSpeed's
    attribute for gradients it must not reduce), so its hooks skip the parameters and no
    placeholder is made or reduced (ZeRO-0 needs none either)."""

    def __init__(self, n: int, lo: int, hi: int, *, placeholder_grads: bool):
        super().__init__(n, lo, hi)
        self.placeholder_grads = placeholder_grads


class LayoutFreeUpdate:
    """Holds the route, the current mini-batch's sink and the step's per-sequence metric terms
    (the policy worker's and PPO's critic's alike)."""

    layout_free = True
    loss_scale = None  # each token's loss weighted by exact global counts
    make_optimizer = LayoutFreeAdamW

    def __init__(self, model, engine, optimizer, *, rank: int, world: int, zero_stage: int):
        """`model`: the patched model whose ops send the partials (the policy, or the critic's
        value model); `engine`: DeepSpeed's engine around it."""
        self.engine, self.optimizer = engine, optimizer
        self.rank, self.world, self.zero_stage = rank, world, zero_stage
        self.route = GradientRoute()
        bind_gradient_route(model, self.route)
        self.named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        if zero_stage == 3:  # its hooks would reduce nothing but placeholders: skip them
            for param in self.params:
                param.ds_grad_is_ready = False
        self.sink: DeepSpeedSink | None = None
        self.new_step()

    def new_step(self) -> None:
        """Zero `norm`, `timings` and `held` (the step loop calls it at the start of a step)."""
        self.norm: float | None = None
        self.timings = dict.fromkeys(PARTS, 0.0)
        self.held = {"tensors": 0, "peak_tensors": 0, "bytes": 0}
        self._mark = time.perf_counter()

    def _lap(self, part: str) -> None:
        now = time.perf_counter()
        self.timings[part] += now - self._mark
        self._mark = now

    # ------------------------------------------------------------------ a mini-batch

    def start(self, per_rank: int) -> None:
        """A new mini-batch of `per_rank` sequences on every rank."""
        lo = self.rank * per_rank
        self.sink = DeepSpeedSink(
            per_rank * self.world,
            lo,
            lo + per_rank,
            placeholder_grads=self.zero_stage in (1, 2),
        )
        self.per_rank = per_rank
        self._mark = time.perf_counter()

    def indices(self, mb: MicroBatch, first_row: int) -> list[int]:
        """The canonical indices of `mb`'s sequences (`first_row`: the mini-batch's first
        shard row)."""
        return [self.sink.lo + row - first_row for row in mb.sequences]

    def route_micro_batch(self, mini: int, mb: MicroBatch | None) -> None:
        """Point the route at micro-batch `mb` of mini-batch `mini` (None: the empty
        micro-batch's dummy row) before its forward."""
        first_row = mini * self.per_rank
        self.route_forward(mb, [] if mb is None else self.indices(mb, first_row))

    def route_forward(self, mb: MicroBatch | None, indices: list[int]) -> None:
        """Point the route at `mb`'s rows (None: the empty micro-batch's dummy row)."""
        if mb is None:
            spans = SequenceSpans(2, (), (), ())
            self.route.set(self.sink, spans, SequenceSpans(1, (), (), ()))
            return
        self.route.set(self.sink, *micro_batch_spans(mb, indices))

    def finish(self, max_norm: float) -> None:
        """The mini-batch's update, up to DeepSpeed's step (collective); sets `norm`."""
        self._lap("forward_backward")
        self.route.clear()
        ranges = [(r * self.per_rank, (r + 1) * self.per_rank) for r in range(self.world)]
        written = {id(p) for p in self.sink.params()}
        missing = [name for name, p in self.named if id(p) not in written]
        if missing:
            raise LayoutFreeError(
                f"{len(missing)} parameter(s) received no per-sequence partials, e.g. "
                f"{missing[:3]}: an op on their path does not serve trainer.layout_invariant"
            )
        self._count_held()
        # one parameter at a time, its partials released as soon as its gradient is formed, so
        # that no second copy of the model's gradient is ever held; the clip scales in the
        # optimizer (`arm`), so the gradients go in before their norm is known
        squares = []
        for index in release_order(self.params):
            param = self.params[index]
            grad = whole_gradient(self.sink, param, ranges).to(param.dtype)
            self.sink.release(param)
            self._lap("whole_gradients")
            squares += row_square_sums(grad)
            self._lap("norm")
            inject_gradient(param, grad, index)
            self._lap("inject")
        self.sink = None
        self.norm = math.sqrt(exact_sum(squares))  # global_norm's sum: exact in any order
        self.optimizer.arm(clip_coefficient(self.norm, max_norm))

    def stepped(self) -> None:
        """DeepSpeed's step after `finish` is done (its time goes to timings['deepspeed_step'])."""
        self._lap("deepspeed_step")

    def empty_sums(self, kind: type[Sums]) -> SequenceRecords:
        return SequenceRecords(kind)

    def totals(self, sums: SequenceRecords, comm) -> Sums:
        """Exact sums over every rank's sequences (collective)."""
        return sums.total(comm.all_gather)

    def _count_held(self) -> None:
        """The sink's tensors and bytes now (the end of the backward) and its peak count."""
        values = [
            node.value
            for param in self.sink.params()
            for nodes in self.sink.nodes(param).values()
            for node in nodes
        ]
        tensors = [t for v in values for t in value_tensors(v)]
        held = self.held
        held["tensors"] = max(held["tensors"], len(tensors))
        held["peak_tensors"] = max(held["peak_tensors"], self.sink.peak_held())
        held["bytes"] = max(held["bytes"], sum(t.numel() * t.element_size() for t in tensors))


def release_order(params) -> list[int]:
    """The order `finish` forms the gradients in (the same on every rank): the parameters'
    own, those whose partials outgrow a slab (an embedding, an LM head) last. Their whole
    gradient and the other ranks' covers are the step's largest transients; by their turn
    every other parameter's partials are released."""
    large = [4 * getattr(p, "ds_numel", p.numel()) > SLAB_BYTES // 4 for p in params]  # fp32
    return sorted(range(len(params)), key=lambda i: large[i])


def micro_batch_spans(mb: MicroBatch, indices: list[int]) -> tuple[SequenceSpans, SequenceSpans]:
    """(the decoder's spans, linear_logp's spans) of `mb`: a sequence's decoder rows are its
    tokens; its logprob rows are the positions that score its next token (all but its last),
    padded or packed alike, so both layouts give a sequence the same rows in the same order."""
    if mb.packed is None:
        mask = mb.batch.attention_mask
        decoder = SequenceSpans.from_padding_mask(mask, indices)
        scored = mask[:, 1:] & mask[:, :-1]
        return decoder, SequenceSpans.from_padding_mask(scored, indices)
    decoder = SequenceSpans.from_segments(mb.packed.segments, indices)
    logp = SequenceSpans(
        decoder.rows,
        decoder.starts,
        tuple(max(length - 1, 0) for length in decoder.lengths),
        decoder.indices,
    )
    return decoder, logp
