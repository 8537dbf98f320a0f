"""`ShardedLinear`: rows [start, stop) of a linear layer, the output shard every tensor-parallel
projection is built of (shard.py places them; shard_lora.py builds a LoRA layer's W, A and
B of them).
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.rollout.tp.collectives import ShardGroup


class ShardedLinear(nn.Module):
    """Rows [start, stop) of a linear layer's weight (and bias): an output shard.

    input_widths: every rank's share of the input features, gathered before the
    projection (None: the input is whole here). output_widths: gather the outputs
    of every rank after it (None: keep this rank's shard).
    """

    def __init__(
        self,
        base: nn.Module,
        rows: tuple[int, int],
        group: ShardGroup,
        *,
        input_widths: tuple[int, ...] | None = None,
        output_widths: tuple[int, ...] | None = None,
        view: bool = False,
    ):
        """view: keep the rows as a view of `base.weight` (an LM head tied to the replicated
        embedding: the embedding's updates reach it, no second copy); else a copy."""
        super().__init__()
        start, stop = rows
        self.rows, self.group = rows, group
        self.input_widths, self.output_widths = input_widths, output_widths
        self.op = getattr(base, "op", None)  # the patched op; None: unpatched (plain F.linear)
        rows_of = base.weight.detach()[start:stop]
        self.weight = nn.Parameter(rows_of if view else rows_of.clone(), requires_grad=False)
        bias = getattr(base, "bias", None)
        shard = None if bias is None else bias.detach()[start:stop].clone()
        self.bias = None if shard is None else nn.Parameter(shard, requires_grad=False)
        self.in_features = base.weight.shape[1]
        self.out_features = base.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_widths is not None:
            x = self.group.gather_last(x, self.input_widths)
        if self.op is not None:
            y = self.op(x, self.weight, self.bias)
        else:
            y = nn.functional.linear(x, self.weight, self.bias)
        if self.output_widths is not None:
            y = self.group.gather_last(y, self.output_widths)
        return y

    def extra_repr(self) -> str:
        start, stop = self.rows
        return (
            f"rows=[{start}, {stop}) of {self.out_features}, in_features={self.in_features}, "
            f"gather_input={self.input_widths is not None}, "
            f"gather_output={self.output_widths is not None}, patched={self.op is not None}"
        )
