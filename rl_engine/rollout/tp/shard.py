"""Split a (patched) dense decoder in place into this rank's output shards.

Every projection becomes a `ShardedLinear` holding only the rows of its weight
that this rank computes (`TPLayout`), calling the op the model was patched
with (resolved through `get_op` by the patching layer), or `F.linear` for an
unpatched model. Where a layer's input is split across ranks (o_proj reads the
attention heads, down_proj the MLP width) the input is all-gathered first, and
where the residual stream needs the whole output (o_proj, down_proj) the
output is all-gathered after: bits are copied, never summed. A PEFT LoRA layer
becomes a `ShardedLoraLinear` (shard_lora.py): its B split by output rows like W,
its A (rank x K) whole on every rank.

Per layer and token each rank sends (Hq * D + I) / N + 2 * H / N elements
(docs/scaling.md); q/k/v and gate/up outputs stay local.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.rollout.tp.collectives import ShardGroup
from rl_engine.rollout.tp.layout import TPLayout
from rl_engine.rollout.tp.shard_lora import sharded_projection
from rl_engine.rollout.tp.sharded_linear import ShardedLinear
from rl_engine.rollout.weight_plan import DimSlice, WeightManifest, WeightPlan

TP_LAYOUT_ATTR = "_rl_tp_layout"
TP_ROWS_ATTR = "_rl_tp_rows"  # state-dict name -> (start, stop) rows this rank holds
TP_ALIASES_ATTR = "_rl_tp_aliases"  # state-dict name -> the names it was tied to before sharding
TP_VIEWS_ATTR = "_rl_tp_views"  # sharded names that are views of a whole tensor held here


def shard_model(model: nn.Module, group: ShardGroup) -> TPLayout:
    """Replace every projection of `model` by this rank's shard; returns the layout.

    Raises ValueError naming the dimension that does not split over the group, or
    the module the dense-decoder layout does not find. The model cannot be
    reverted or unsharded afterwards (the other rows are dropped).
    """
    if getattr(model, TP_LAYOUT_ATTR, None) is not None:
        raise ValueError("the model is already sharded")
    layout = TPLayout.from_config(model.config, group.world)
    rank = group.rank
    tied = _tied_names(model)
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.base_model.layers")
    for index, layer in enumerate(layers):
        _shard_attention(_child(layer, "self_attn", index, weight=False), layout, group, index)
        _shard_mlp(_child(layer, "mlp", index, weight=False), layout, group, index)
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__}: no output embeddings (lm_head) to shard")
    tied_head = head.weight is getattr(model.get_input_embeddings(), "weight", None)
    vocab_rows = layout.rows("vocab", rank)
    model.set_output_embeddings(ShardedLinear(head, vocab_rows, group, view=tied_head))
    rows = {
        f"{name}.{kind}": module.rows
        for name, module in model.named_modules()
        if isinstance(module, ShardedLinear)
        for kind in ("weight", "bias")
        if getattr(module, kind) is not None
    }
    setattr(model, TP_ROWS_ATTR, rows)
    names = model.state_dict(keep_vars=True)
    setattr(model, TP_ALIASES_ATTR, {n: [a for a in tied.get(n, ()) if a != n] for n in names})
    head_name = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    setattr(model, TP_VIEWS_ATTR, {f"{head_name}.weight"} if tied_head else set())
    setattr(model, TP_LAYOUT_ATTR, layout)
    return layout


def shard_state_dict(model: nn.Module, state_dict) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict cut to this rank's rows of a sharded model: every sharded
    name gets its rows (taken from a tied alias when the name itself is absent), every other
    tensor passes whole. Views, no copies."""
    rows = getattr(model, TP_ROWS_ATTR, None)
    if rows is None:
        raise ValueError("the model is not sharded (shard_model first)")
    aliases = getattr(model, TP_ALIASES_ATTR)
    out = dict(state_dict)
    for name, (start, stop) in rows.items():
        source = next((n for n in (name, *aliases[name]) if n in state_dict), None)
        if source is None:
            continue  # plan_weight_copy names the missing key
        value = state_dict[source]
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] < stop:
            raise ValueError(
                f"state_dict[{source!r}] cannot give rows [{start}, {stop}) of {name!r}: "
                f"shape {tuple(getattr(value, 'shape', ()))}"
            )
        out[name] = value[start:stop]
    return out


def tp_layout(model: nn.Module) -> TPLayout | None:
    """The layout a sharded model was split with, or None (not sharded)."""
    return getattr(model, TP_LAYOUT_ATTR, None)


def _shard_attention(attn: nn.Module, layout: TPLayout, group: ShardGroup, index: int) -> None:
    rank = group.rank
    for norm in ("q_norm", "k_norm"):
        weight = getattr(getattr(attn, norm, None), "weight", None)
        if weight is not None and weight.numel() != layout.head_dim:
            raise ValueError(
                f"layer {index}: {norm} spans {weight.numel()} features, not one head "
                f"({layout.head_dim}): a norm across heads would need every head on one rank"
            )
    hidden = _child(attn, "o_proj", index).weight.shape[0]
    for name, kind in (("q_proj", "q"), ("k_proj", "kv"), ("v_proj", "kv")):
        rows = layout.rows(kind, rank)
        _replace(attn, name, _projection(attn, name, index, rows, group))
    o_proj = _projection(
        attn,
        "o_proj",
        index,
        layout.rows("hidden", rank, hidden),
        group,
        input_widths=layout.widths("q"),
        output_widths=layout.widths("hidden", hidden),
    )
    _replace(attn, "o_proj", o_proj)
    q_heads = layout.num_heads // layout.world
    kv_start, kv_stop = layout.kv_heads(rank)
    attn.num_key_value_groups = q_heads // (kv_stop - kv_start)  # read by eager / sdpa paths


def _shard_mlp(mlp: nn.Module, layout: TPLayout, group: ShardGroup, index: int) -> None:
    rank = group.rank
    for name in ("gate_proj", "up_proj"):
        _replace(mlp, name, _projection(mlp, name, index, layout.rows("mlp", rank), group))
    hidden = _child(mlp, "down_proj", index).weight.shape[0]
    down = _projection(
        mlp,
        "down_proj",
        index,
        layout.rows("hidden", rank, hidden),
        group,
        input_widths=layout.widths("mlp"),
        output_widths=layout.widths("hidden", hidden),
    )
    _replace(mlp, "down_proj", down)


def shard_rows(model: nn.Module) -> dict[str, tuple[int, int]]:
    """State-dict name -> the rows [start, stop) of the full tensor this rank holds (sharded
    tensors only)."""
    rows = getattr(model, TP_ROWS_ATTR, None)
    if rows is None:
        raise ValueError("the model is not sharded (shard_model first)")
    return dict(rows)


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """State-dict name -> the other names its tensor had before sharding (tied weights)."""
    return dict(getattr(model, TP_ALIASES_ATTR))


def weight_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight sync writes on this rank, by state-dict name: every parameter and
    buffer except the views of a whole tensor (a tied LM head's rows of the embedding)."""
    views = getattr(model, TP_VIEWS_ATTR, set())
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in views}


def weight_plan_for(model: nn.Module, manifest: WeightManifest) -> WeightPlan:
    """What this rank receives of a sync: the rows it holds of each sharded tensor
    (`DimSlice` of dim 0), every replicated tensor whole (a plan per receiver)."""
    rows = getattr(model, TP_ROWS_ATTR, None)
    if rows is None:
        raise ValueError("the model is not sharded (shard_model first)")
    views = getattr(model, TP_VIEWS_ATTR)
    slices: dict[str, DimSlice | None] = {}
    for spec in manifest.tensors:
        sharded = [n for n in spec.names if n in rows and n not in views]
        span = rows[sharded[0]] if sharded else None
        if span is None or span == (0, spec.shape[0]):  # replicated (e.g. a lone KV head)
            slices[spec.name] = None
        else:
            slices[spec.name] = DimSlice(0, (span,))
    return WeightPlan(slices)


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """name -> every state-dict name of the same tensor (tied weights), before sharding."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() for name in names}


def _projection(
    parent: nn.Module, name: str, index: int, rows: tuple[int, int], group: ShardGroup, **gathers
) -> nn.Module:
    """The output shard of `parent.name`: a `ShardedLinear`, or for a PEFT LoRA layer a
    `ShardedLoraLinear` (its B split like W, its A whole: rl_engine/rollout/tp/shard_lora.py)."""
    path = f"layers.{index}.{name}"
    return sharded_projection(_child(parent, name, index), path, rows, group, **gathers)


def _child(module: nn.Module, name: str, index: int, *, weight: bool = True) -> nn.Module:
    child = getattr(module, name, None)
    has_weight = isinstance(getattr(child, "weight", None), torch.Tensor)
    if child is None or (weight and not has_weight):
        raise ValueError(
            f"layer {index}: {type(module).__name__} has no {name} with a weight; tensor "
            "parallelism supports dense decoders (q/k/v/o_proj, gate/up/down_proj)"
        )
    return child


def _replace(parent: nn.Module, name: str, module: nn.Module) -> None:
    setattr(parent, name, module)
