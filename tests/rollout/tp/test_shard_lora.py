"""Tensor-parallel engines serve a LoRA policy with the TP = 1 engine's bits.

Chain: the TP = 1 engine serves `linear(x, W) + scale * linear(linear(x, A), B)` unmerged;
a TP = 2 engine holds rows [start, stop) of W and B and all of A on each rank (shard outputs,
never reductions), so every output element is the same chain on one rank and the gathers copy
it: completions and logprobs equal TP = 1's bit for bit, before and after a weight update
that redraws the adapters. The weight plan sends each rank its rows of B (the rows of W it
holds) and the whole A. Negative control: the same TP = 2 engine with the adapters merged
into W differs. These TP = 2 tests live in tests/rollout/tp/test_launch.py, whose one spawn
of 2 ranks runs them: tiny-llama fp32, tiny-qwen3 bf16 (uneven vocabulary, q/k norms),
tiny-llama-1003 (uneven MLP, one KV head replicated: k/v's B whole everywhere).

In one process (a world of one rank): a `ShardedLoraLinear` of rows [start, stop) gives
columns [start, stop) of the patched LoRA layer's output, torch.equal (negative control: the
adapter merged into W does not); `sharded_projection` shards a LoRA layer as one and any other
projection as a `ShardedLinear`, and refuses adapters on a layer that is not PEFT's Linear.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.lora import add_lora
from rl_engine.rollout.tp import ShardedLinear, ShardGroup
from rl_engine.rollout.tp.shard_lora import ShardedLoraLinear, sharded_projection

Q_PROJ = "model.layers.0.self_attn.q_proj"


def _lora_q_proj() -> nn.Module:
    """A patched tiny-llama's first q_proj with a perturbed adapter (B != 0)."""
    model, _ = load_model("tiny-llama")
    add_lora(model, rank=4, alpha=8, target_modules="all-linear", seed=0)
    apply_batch_invariant(model)
    layer = model.get_submodule(Q_PROJ)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    return layer


def _merged(layer: nn.Module) -> nn.Module:
    """The same adapter merged into W, run by the same patched op."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    merged = nn.Linear(layer.in_features, layer.out_features, bias=False)
    merged.weight.data = layer.base_layer.weight.detach() + layer.scaling["default"] * (b @ a)
    merged.op = layer.base_layer.op
    return merged


def test_one_ranks_lora_rows_are_the_whole_layers_columns(one_rank_group):
    layer, group = _lora_q_proj(), ShardGroup()
    sharded = sharded_projection(layer, Q_PROJ, (3, 40), group)
    assert isinstance(sharded, ShardedLoraLinear)
    assert sharded.lora_A["default"].weight.shape == layer.lora_A["default"].weight.shape
    assert torch.equal(sharded.weight, layer.base_layer.weight[3:40])
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad():
        want = layer(x)[..., 3:40]
        assert torch.equal(sharded(x), want)
        assert not torch.equal(ShardedLinear(_merged(layer), (3, 40), group)(x), want)


def test_a_plain_projection_is_a_sharded_linear_and_foreign_adapters_are_refused(one_rank_group):
    group, plain = ShardGroup(), nn.Linear(4, 6)
    assert type(sharded_projection(plain, "head", (0, 3), group)) is ShardedLinear
    holder = nn.Module()
    holder.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2)})
    with pytest.raises(ValueError, match="head: adapters on a Module cannot be sharded"):
        sharded_projection(holder, "head", (0, 3), group)
