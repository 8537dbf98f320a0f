"""The critic's micro-batch loss: PPO's clipped value loss as a token mean over the mini-batch.

Plain path: the micro-batch's share of its mini-batch's token mean (the sum of its tokens'
terms over U, the mini-batch's completion tokens on every rank), rescaled by `scale` to undo
DeepSpeed's averaging, with one `ValueLossSums` record per micro-batch.

Layout-invariant path (`trainer.layout_invariant`): each token's term times the weight 1 / U
that its sequence and the exact global count alone define (`layout_free_loss.token_weights`,
token-mean), so the gradient reaching a token is that weight whatever else the micro-batch
holds; the metrics are one record per sequence (`SequenceRecords`), totalled exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.algorithms import value_loss_terms
from rl_engine.executors.worker.layout_free.loss import sequence_records, token_weights
from rl_engine.exact.records import SequenceRecords, Sums


@dataclass(frozen=True, slots=True)
class ValueLossSums(Sums):
    """A micro-batch's (or a sequence's) clipped value loss and token counts, summed over
    micro-batches and ranks."""

    loss: float = 0.0
    """Its share of its mini-batch's token-mean clipped value loss."""
    clipped: float = 0.0
    """Completion tokens whose clipped error was the larger."""
    tokens: float = 0.0
    """Its completion tokens."""


def value_micro_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float,
    units: float,
    scale: int | None,
) -> tuple[torch.Tensor, ValueLossSums | SequenceRecords]:
    """(loss to backpropagate, its record) of one micro-batch; `units`: the mini-batch's
    completion tokens over every rank. `scale` None: the layout-invariant loss and records."""
    per_token, clipped = value_loss_terms(values, returns, old_values, mask, clip=clip)
    if scale is None:
        weighted = per_token * token_weights(mask, "token-mean", units)
        columns = {"loss": weighted, "clipped": clipped.float(), "tokens": mask.float()}
        return weighted.sum(), sequence_records(ValueLossSums, columns, mask)
    loss = per_token.sum() / units
    record = ValueLossSums.from_tensors(loss=loss, clipped=clipped.sum(), tokens=mask.sum())
    return loss * scale, record
