"""`ShardedLinear`: rows [start, stop) of a linear layer, one rank's output shard.

In a world of one rank (in-process): a patched shard's output == columns [start, stop) of the
patched full layer's output, torch.equal (the invariant op computes each output element from
its own row alone; negative control: the rows one further down do not match); the bias is
sliced with the weight; the shard is a copy of the rows, or a view when asked (a tied LM head:
the embedding's updates reach it); an unpatched layer runs plain F.linear on the same rows.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.rollout.tp import ShardedLinear, ShardGroup
from tests.helpers.rollout.common import patched_model


def _patched_projection() -> nn.Module:
    return patched_model("tiny-qwen2").model.layers[0].self_attn.q_proj  # has a bias


def test_a_patched_shard_gives_the_full_layers_columns_bit_for_bit(one_rank_group):
    layer = _patched_projection()
    shard = ShardedLinear(layer, (5, 37), ShardGroup())
    assert torch.equal(shard.bias, layer.bias[5:37]) and shard.op is layer.op
    x = torch.randn(3, 7, layer.weight.shape[1])
    with torch.no_grad():
        want = layer(x)[..., 5:37]
        assert torch.equal(shard(x), want)
        assert not torch.equal(ShardedLinear(layer, (6, 38), ShardGroup())(x), want)


def test_the_rows_are_a_copy_unless_a_view_is_asked(one_rank_group):
    base = nn.Linear(4, 6, bias=False)
    copy = ShardedLinear(base, (2, 5), ShardGroup())
    view = ShardedLinear(base, (2, 5), ShardGroup(), view=True)
    before = base.weight.detach()[2:5].clone()
    with torch.no_grad():
        base.weight.add_(1.0)
    assert torch.equal(view.weight, base.weight[2:5])
    assert torch.equal(copy.weight, before) and not torch.equal(before, base.weight[2:5])
    assert not copy.weight.requires_grad and copy.bias is None


def test_an_unpatched_shard_runs_plain_linear_and_says_what_it_is(one_rank_group):
    base = nn.Linear(4, 6)
    shard = ShardedLinear(base, (1, 4), ShardGroup(), input_widths=(4,))
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(shard(x), nn.functional.linear(x, base.weight[1:4], base.bias[1:4]))
    assert (shard.in_features, shard.out_features, shard.op) == (4, 6, None)
    assert repr(shard).endswith(
        "(rows=[1, 4) of 6, in_features=4, gather_input=True, gather_output=False, patched=False)"
    )
