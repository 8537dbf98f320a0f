"""A PEFT LoRA layer split over the ranks of a tensor-parallel engine, by the same rule as W.

The layer computes `y = linear(x, W) + scale * linear(linear(x, A), B)` (the patched,
unmerged expression of rl_engine/patching/lora.py). "Shard outputs, never reductions":

- the input is whole (gathered first where the base layer's input is split: o_proj, down_proj);
- A (rank x K) reduces over K, so every rank holds all of it and computes the whole
  `linear(x, A)`, the same chain as one rank;
- W and B are split by their output rows: rank r computes rows [start, stop) of both, so
  each output element is the TP = 1 engine's `W x + scale * B (A x)`, same ops, same order;
- the output is gathered after where the residual stream needs all of it.

State-dict names stay PEFT's (`<path>.base_layer.weight`, `<path>.lora_A.default.weight`,
`<path>.lora_B.default.weight`): a weight sync sends each rank its rows of W and B and the
whole A (`weight_plan_for`: A's rows are all of A, so it is replicated).
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.patching.lora import ADAPTER, check_plain_lora, is_adapter_name, lora_layer_class
from rl_engine.rollout.tp.collectives import ShardGroup
from rl_engine.rollout.tp.sharded_linear import ShardedLinear


class ShardedLoraLinear(nn.Module):
    """Rows [start, stop) of a LoRA layer's W and B, all of its A: an output shard.

    input_widths / output_widths: as `ShardedLinear` (gather the input before, the output
    after; None: whole input here, keep this rank's output rows).
    """

    def __init__(
        self,
        layer: nn.Module,
        rows: tuple[int, int],
        group: ShardGroup,
        *,
        input_widths: tuple[int, ...] | None = None,
        output_widths: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.rows, self.group = rows, group
        self.input_widths, self.output_widths = input_widths, output_widths
        a = layer.lora_A[ADAPTER]
        self.base_layer = ShardedLinear(layer.base_layer, rows, group)
        self.lora_A = nn.ModuleDict({ADAPTER: ShardedLinear(a, (0, a.weight.shape[0]), group)})
        self.lora_B = nn.ModuleDict({ADAPTER: ShardedLinear(layer.lora_B[ADAPTER], rows, group)})
        self.scale = float(layer.scaling[ADAPTER])
        self.in_features, self.out_features = self.base_layer.in_features, layer.out_features

    @property
    def weight(self) -> nn.Parameter:
        """The base weight's rows (what a `ShardedLinear` in this place would hold)."""
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_widths is not None:
            x = self.group.gather_last(x, self.input_widths)
        down = self.lora_A[ADAPTER](x)  # (..., rank): whole on every rank
        y = self.base_layer(x) + self.scale * self.lora_B[ADAPTER](down)
        if self.output_widths is not None:
            y = self.group.gather_last(y, self.output_widths)
        return y

    def extra_repr(self) -> str:
        start, stop = self.rows
        return (
            f"rows=[{start}, {stop}) of {self.out_features} (W and B; A whole), "
            f"scale={self.scale}, gather_input={self.input_widths is not None}, "
            f"gather_output={self.output_widths is not None}"
        )


def sharded_projection(
    module: nn.Module, path: str, rows: tuple[int, int], group: ShardGroup, **gathers
) -> nn.Module:
    """The output shard of a projection: a `ShardedLoraLinear` for a PEFT LoRA layer (checked
    to be the one plain unmerged adapter the invariant forward computes), else a `ShardedLinear`."""
    if any(is_adapter_name(name) for name, _ in module.named_parameters(prefix=path)):
        if not isinstance(module, lora_layer_class()):
            raise ValueError(f"{path}: adapters on a {type(module).__name__} cannot be sharded")
        check_plain_lora(path, module)
        return ShardedLoraLinear(module, rows, group, **gathers)
    return ShardedLinear(module, rows, group, **gathers)
