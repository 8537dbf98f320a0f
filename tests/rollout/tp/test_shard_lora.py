"""Tensor-parallel engines serve a LoRA policy with the TP = 1 engine's bits.

Chain: the TP = 1 engine serves `linear(x, W) + scale * linear(linear(x, A), B)` unmerged;
a TP = 2 engine holds rows [start, stop) of W and B and all of A on each rank (shard outputs,
never reductions), so every output element is the same chain on one rank and the gathers copy
it: completions and logprobs equal TP = 1's bit for bit, before and after a weight update
that redraws the adapters. The weight plan sends each rank its rows of B (the rows of W it
holds) and the whole A. Negative control: the same TP = 2 engine with the adapters merged
into W differs. One spawn of 2 ranks: tiny-llama fp32, tiny-qwen3 bf16 (uneven vocabulary,
q/k norms), tiny-llama-1003 (uneven MLP, one KV head replicated: k/v's B whole everywhere).

In one process (a world of one rank): a `ShardedLoraLinear` of rows [start, stop) gives
columns [start, stop) of the patched LoRA layer's output, torch.equal (negative control: the
adapter merged into W does not); `sharded_projection` shards a LoRA layer as one and any other
projection as a `ShardedLinear`, and refuses adapters on a layer that is not PEFT's Linear.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.lora import add_lora
from rl_engine.rollout.tp import ShardedLinear, ShardGroup, launch
from rl_engine.rollout.tp.shard_lora import ShardedLoraLinear, sharded_projection
from tests.helpers.rollout import tp_lora_procs

SCENARIOS = (("tiny-llama", "fp32"), ("tiny-qwen3", "bf16"), ("tiny-llama-1003", "fp32"))


@functools.cache
def reference(key: str, dtype: str) -> dict:
    return tp_lora_procs.lora_tp1(key, dtype)


@pytest.fixture(scope="module")
def tp2_runs() -> dict:
    return launch(functools.partial(tp_lora_procs.lora_sharded, SCENARIOS), 2)


def same(got: dict, want: dict) -> bool:
    return got["tokens"] == want["tokens"] and all(
        a.dtype == torch.float32 and torch.equal(a, b)
        for a, b in zip(got["logprobs"], want["logprobs"], strict=True)
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: "-".join(s))
def test_tp2_lora_equals_tp1_before_and_after_a_weight_update(tp2_runs, scenario):
    got, want = tp2_runs[scenario], reference(*scenario)
    for phase in ("first", "after_sync"):
        assert same(got[phase], want[phase]), phase
        assert got[phase]["finish"] == want[phase]["finish"]
        assert got[phase]["batch_sizes"] == want[phase]["batch_sizes"]
    assert want["first"]["tokens"] != want["after_sync"]["tokens"]  # the update mattered


@pytest.mark.multiprocess
def test_an_engine_that_merges_the_adapters_differs(tp2_runs):
    assert not same(tp2_runs["merged"], reference(*SCENARIOS[0])["first"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: "-".join(s))
def test_the_weight_plan_sends_each_rank_its_b_rows_and_the_whole_a(tp2_runs, scenario):
    plan = tp2_runs[scenario]["plan"]
    ranks, shapes = plan["ranks"], plan["shapes"]
    a_names = [n for n in plan["adapters"] if ".lora_A." in n]
    b_names = [n for n in plan["adapters"] if ".lora_B." in n]
    assert len(a_names) == len(b_names) == 14
    split = 0
    for b in b_names:
        w = b.replace(".lora_B.default.", ".base_layer.")
        pieces = [r["rows"][b] for r in ranks]
        assert [r["rows"][w] for r in ranks] == pieces  # B's rows are the rows of W it holds
        if pieces[0] is None:  # a replicated output (a lone KV head): whole on every rank
            assert all(p is None for p in pieces)
            continue
        split += 1
        spans = [span for piece in pieces for span in piece]
        assert spans[0][0] == 0 and spans[-1][1] == shapes[b][0]
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert split >= 10
    assert all(r["rows"][a] is None for r in ranks for a in a_names)  # A whole everywhere
    for r in ranks:  # an adapters-only sync: the whole A and this rank's B rows, nothing else
        a_bytes = sum(_numel(shapes[a]) * plan["itemsize"][a] for a in a_names)
        b_bytes = sum(_rows_bytes(r["rows"][b], shapes[b], plan["itemsize"][b]) for b in b_names)
        assert r["adapter_nbytes"] == a_bytes + b_bytes < r["nbytes"]


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _rows_bytes(piece, shape, itemsize: int) -> int:
    rows = shape[0] if piece is None else sum(stop - start for start, stop in piece)
    return rows * _numel(shape[1:]) * itemsize


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
