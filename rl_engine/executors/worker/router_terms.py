"""The router terms of a mixture-of-experts policy in a training step: auxiliary loss and expert load.

Each micro-batch's first forward records the policy's routing
(`rl_engine.patching.RoutingRecorder`: every sparse layer's router logits and
chosen experts, rows = the micro-batch's tokens). With
`algorithm.router_aux_loss_coef` > 0 the load-balancing loss of those logits
over the real tokens (rl_engine/algorithms/router.py: HF's formula) joins the
micro-batch's loss, weighted by its share of its mini-batch's real tokens on all
ranks: the step minimises policy loss + coef x the token-weighted mean of its
micro-batches' auxiliary losses (`router/aux_loss`). The expert load is summed
over micro-batches and ranks: `router/max_load_share` (the most loaded
expert's share of the routed token-slots, mean over layers; 1/E is balanced),
`router/max_load_share_worst_layer` and `router/load_entropy` (nats; ln E is
balanced). A dense policy has no router terms and reports none; a
coefficient > 0 for it is refused.

Under trainer.layout_invariant the auxiliary loss is the sequence-wise balance loss instead
(router_balance.py: HF's formula over each sequence's own tokens, weighted by its share of the
mini-batch's tokens), whose gradient and metric no layout enters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rl_engine.algorithms import expert_counts, load_balancing_loss, load_statistics
from rl_engine.config import RunConfig
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.layout_free.update import micro_batch_spans
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.layout_free.router_balance import AuxSums, sequence_balance
from rl_engine.patching import RoutingRecorder, moe_layers, router_settings
from rl_engine.exact.records import SequenceRecords


class RouterTerms:
    """One worker's router bookkeeping: `start` each step (collective: the step's token count),
    `recording` + `loss` per micro-batch, `metrics` at the end (collective, like the other sums).
    trainer.layout_invariant: the sequence-wise balance loss, its metric per-sequence records."""

    def __init__(self, policy: nn.Module, config: RunConfig):
        self.policy, self.coef = policy, float(config.algorithm.router_aux_loss_coef)
        self.layout_invariant = config.trainer.layout_invariant
        self.layers = moe_layers(policy)
        if not self.layers:
            if self.coef > 0:
                raise ValueError(
                    f"algorithm.router_aux_loss_coef is {self.coef} but model {config.model!r} "
                    "has no mixture-of-experts router; set it to 0"
                )
            return
        self.num_experts, _ = router_settings(policy)

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def start(self, minis: list[list[MicroBatch | None]], all_reduce: Callable) -> None:
        """Zero the step's sums; count each mini-batch's real tokens on all ranks (None: an
        empty micro-batch, which another rank has more of)."""
        if not self.active:
            return
        self.counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64)
        self.aux = torch.zeros(1, dtype=torch.float64)
        self.records = SequenceRecords(AuxSums)
        local = [
            sum(float(mb.batch.attention_mask.sum()) for mb in micro if mb is not None)
            for micro in minis
        ]
        total = all_reduce(torch.tensor(local, dtype=torch.float64))
        self.tokens = [max(float(t), 1.0) for t in total]

    @contextmanager
    def recording(self) -> Iterator[RoutingRecorder | None]:
        """The routing of the forwards inside (logits kept on the graph for the auxiliary loss)."""
        if not self.active:
            yield None
            return
        with RoutingRecorder(self.policy, detach=self.coef == 0) as recorder:
            yield recorder

    def loss(
        self, recorder: RoutingRecorder | None, mb: MicroBatch | None, scale: int, mini: int = 0
    ):
        """This micro-batch's auxiliary-loss term (to add to its loss), weighted by its share of
        mini-batch `mini`'s tokens, or None; counts its load. An empty micro-batch (None) routes
        only its dummy row: no term, no load."""
        if recorder is None or mb is None:
            return None
        mask = forward_token_mask(mb)
        logits = [torch.cat([c.logits for c in recorder.calls[name]]) for name in self.layers]
        indices = [torch.cat([c.indices for c in recorder.calls[name]]) for name in self.layers]
        self.counts += expert_counts(indices, self.num_experts, mask)
        if self.layout_invariant:
            return self._sequence_loss(logits, indices, mb, mini)
        share = float(mask.sum()) / self.tokens[mini]
        aux = load_balancing_loss(logits, indices, self.num_experts, mask)
        self.aux += float(aux.detach()) * share  # reported with any coefficient, 0 included
        return None if self.coef == 0 else self.coef * aux * share * scale

    def _sequence_loss(self, logits, indices, mb: MicroBatch, mini: int):
        """The sequence-wise balance loss's term (layout_invariant), its records kept. No
        `scale`: the mode's gradients are sums over sequences, never DeepSpeed's averages."""
        spans, _ = micro_batch_spans(mb, list(range(len(mb.sequences))))
        term, records = sequence_balance(
            logits, indices, spans, self.num_experts, int(self.tokens[mini]), self.coef
        )
        self.records = self.records.merge(records)
        return term

    def metrics(self, comm: Collectives, updates: int = 1) -> dict[str, float]:
        """router/* metrics of the step (sums over ranks; aux_loss the mean over its `updates`
        optimizer steps, the load over every training forward); {} for a dense policy.
        layout_invariant: aux_loss is the exact total of every rank's records."""
        if not self.active:
            return {}
        stats = load_statistics(comm.all_reduce(self.counts))
        out = {f"router/{name}": value for name, value in stats.items()}
        if self.layout_invariant:
            aux = self.records.total(comm.all_gather).aux_loss
        else:
            aux = float(comm.all_reduce(self.aux)[0])
        out["router/aux_loss"] = aux / updates
        return out


def forward_token_mask(mb: MicroBatch) -> torch.Tensor:
    """(tokens,) bool: the real tokens among the rows the router saw, in their order: the
    padded (b, T) layout flattened, or the packed rows (padding at their ends)."""
    if mb.packed is not None:
        return (mb.packed.positions >= 0).reshape(-1)
    return mb.batch.attention_mask.reshape(-1).bool()
