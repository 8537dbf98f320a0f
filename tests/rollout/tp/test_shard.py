"""Sharding a dense decoder in place (rollout/tp/shard.py): which rows each rank keeps.

In one process, a group of one rank that calls itself rank 1 of 2 (sharding only computes
rows; no collective runs): every projection becomes a `ShardedLinear` holding exactly the rows
`TPLayout` gives rank 1 of the full weight (torch.equal to full[rows]); `shard_rows` lists
them by state-dict name; `shard_state_dict` cuts a full state dict to those rows (views) and
names a tensor too short to give them; `weight_plan_for` asks a sync for those rows and for
every replicated tensor whole. Errors name the bad module or the state-dict key.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout.tp import ShardedLinear, ShardGroup, shard_model, shard_state_dict, tp_layout
from rl_engine.rollout.tp.shard import shard_rows, weight_plan_for
from rl_engine.rollout.weight_plan import DimSlice, WeightManifest
from tests.helpers.rollout.common import fresh_model

Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"


def _rank_one_of_two() -> ShardGroup:
    group = ShardGroup()
    group.rank, group.world = 1, 2
    return group


def _sharded():
    model = fresh_model("tiny-llama")
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, full, shard_model(model, _rank_one_of_two())


def test_every_projection_keeps_its_layout_rows_of_the_full_weight(one_rank_group):
    model, full, layout = _sharded()
    assert tp_layout(model) is layout and layout.world == 2
    rows = shard_rows(model)
    assert rows[Q] == layout.rows("q", 1) and rows[Q][0] > 0
    hidden = full[DOWN].shape[0]
    assert rows[DOWN] == layout.rows("hidden", 1, hidden)
    sharded = dict(model.named_modules())
    assert all(isinstance(sharded[name.rsplit(".", 1)[0]], ShardedLinear) for name in rows)
    for name, (start, stop) in rows.items():
        assert torch.equal(model.state_dict()[name], full[name][start:stop]), name
    assert NORM not in rows and torch.equal(model.state_dict()[NORM], full[NORM])
    with pytest.raises(ValueError, match="the model is already sharded"):
        shard_model(model, _rank_one_of_two())


def test_a_full_state_dict_is_cut_to_this_ranks_rows(one_rank_group):
    model, full, _ = _sharded()
    start, stop = shard_rows(model)[Q]
    cut = shard_state_dict(model, full)
    assert torch.equal(cut[Q], full[Q][start:stop]) and cut[NORM] is full[NORM]
    assert cut[Q].data_ptr() == full[Q][start:stop].data_ptr()  # a view, no copy
    short = {**full, Q: full[Q][: start + 1]}
    with pytest.raises(
        ValueError, match=rf"state_dict\['{Q}'\] cannot give rows \[{start}, {stop}\)"
    ):
        shard_state_dict(model, short)
    with pytest.raises(ValueError, match=r"not sharded \(shard_model first\)"):
        shard_state_dict(fresh_model("tiny-llama"), full)


def test_a_sync_plan_asks_for_this_ranks_rows_and_replicated_tensors_whole(one_rank_group):
    model, full, _ = _sharded()
    manifest = WeightManifest.even_split(
        [(name, tuple(t.shape), t.dtype, ()) for name, t in full.items()], 1
    )
    plan = weight_plan_for(model, manifest)
    assert plan.slices[Q] == DimSlice(0, (shard_rows(model)[Q],))
    assert plan.slices[NORM] is None
    plan.check(manifest)


def test_a_decoder_without_a_projection_is_named(one_rank_group):
    model = fresh_model("tiny-llama")
    del model.model.layers[1].mlp.gate_proj
    with pytest.raises(ValueError, match="layer 1: LlamaMLP has no gate_proj with a weight"):
        shard_model(model, _rank_one_of_two())
