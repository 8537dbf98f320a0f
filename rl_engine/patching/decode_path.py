"""The rollout engine's cached forward without transformers' module machinery.

A patched dense decoder (Llama, Qwen2, Qwen3, Mistral) spends a third of a decode step in
Python around its kernels: ~30 layers x ~15 nn.Module calls, HF's kwargs plumbing and
causal-mask machinery (the invariant attention ignores the mask), and a device check in
every patched module. `fast_decoder(model)` reads the patched modules once (their weights,
their resolved ops, their order) and returns a `FastDecoder` that calls the same ops on the
same tensors in the same order as the module path:

    embed -> rotary (cos, sin) -> per layer:
        x = rms_norm(h); q, k, v = linear(x) as (B, H, T, D) [Qwen3: q_norm / k_norm first]
        q, k = the family's apply_rotary_pos_emb; cache.update_slots; attention(kv_index=slots)
        h = h + o_proj(attn); h = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))
    -> final norm;  lm_head(hidden) -> fp32 logits (the patched `lm_head` op)

so every hidden state has the bits of `model.base_model(..., rl_kv_cache=cache)`. Built
`packed_into(store)` (the engine does, once per generate call) the projections and the LM
head run on copies of their weights packed into the engine's store, on a backend that packs
GEMM weights (`BackendLayout.weight_packing`: cpp; packed_weights.py says when they are
made): layout only, the same bits. The
patching stays the one definition of the model: the plan is derived from the patched
modules, and any module it does not recognise exactly (another family, MoE, LoRA, tensor-
parallel shards, forward hooks, training-mode dropout) makes `fast_decoder` return None
with one warning per reason, and the caller keeps the module path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rl_engine.patching.apply import lm_head_parameters
from rl_engine.patching.families import family_for
from rl_engine.patching.handle import PatchHandle, patch_handle
from rl_engine.patching.modules import (
    InvariantEmbedding,
    InvariantLinear,
    InvariantRMSNorm,
    InvariantSiLU,
    check_patched_device,
)
from rl_engine.patching.packed_weights import PackedWeights

logger = logging.getLogger(__name__)

# model_type -> the class-name prefix of its modules in transformers.models.<type>.modeling_<type>
DENSE_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # the _Layer fields that are Proj

_warned: set[str] = set()


class UnsupportedDecoder(Exception):
    """Why a model keeps the module path (internal: `fast_decoder` logs it and returns None)."""


Norm = tuple[Callable, torch.Tensor, float]  # (rms_norm op, weight, eps)
# (linear op, weight, bias), or (packed projection, packed weight, bias)
Proj = tuple[Callable, object, torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's ops and tensors, in the order its forward uses them."""

    index: int  # the attention's layer_idx: the KV cache's layer key
    input_norm: Norm
    q: Proj
    k: Proj
    v: Proj
    q_norm: Norm | None  # Qwen3: RMSNorm over each head before the rotary embedding
    k_norm: Norm | None
    rotary: Callable  # the family's apply_rotary_pos_emb(q, k, cos, sin)
    head_dim: int
    scaling: float
    o: Proj
    post_norm: Norm
    gate: Proj
    up: Proj
    silu: Callable
    down: Proj


def _proj(module: nn.Module) -> Proj:
    return module.op, module.weight, module.bias


def _norm(module: nn.Module) -> Norm:
    return module.op, module.weight, module.eps


class FastDecoder:
    """The decoder forward of one patched dense model as a flat list of op calls."""

    def __init__(self, embed, rotary_emb, layers, norm, attention, head: Proj, handle: PatchHandle):
        self.embed, self.rotary_emb, self.layers = embed, rotary_emb, layers
        self.norm, self.attention, self.head, self.handle = norm, attention, head, handle

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> fp32 logits (..., V): the patched `lm_head` op's bits."""
        return _apply_proj(self.head, hidden)

    def packed_into(self, store: PackedWeights) -> FastDecoder:
        """This plan with its projections and LM head on their weights packed into `store`
        now, when the backend packs (`BackendLayout.weight_packing`; else this plan as it
        is). Only the patched ops' own calls are swapped, for the backend's packed
        projection: layout only, the same bits."""
        packing = self.handle.layout.weight_packing
        if packing is None:
            return self
        ops = self.handle.ops

        def pack(proj: Proj, op: Callable, project: Callable) -> Proj:
            fn, weight, bias = proj
            if fn is not op or not packing.packs(weight):
                return proj
            return project, store.pack(weight, packing), bias

        layers = [
            dataclasses.replace(
                layer,
                **{
                    name: pack(getattr(layer, name), ops["linear"], packing.project)
                    for name in PROJECTIONS
                },
            )
            for layer in self.layers
        ]
        head_project = functools.partial(packing.project, out_dtype=torch.float32)
        head = pack(self.head, ops["lm_head"], head_project)
        parts = (self.embed, self.rotary_emb, layers, self.norm, self.attention, head)
        return FastDecoder(*parts, self.handle)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, cache, real: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids, positions (B, T) (positions >= 0) -> (B, T, H) final-norm hidden states;
        reads and writes `cache` as bound (its `update_slots` protocol, patching/attention.py).
        real (B, T) bool: the cells that are tokens, when some are padding. Then every op but
        the attention runs on the real tokens alone, flattened, and the attention on them
        scattered back into the (B, T) layout: a ragged batch (a verifying forward's rows of
        k + 1 and of 1 token, a prefill chunk beside decodes) computes its tokens, not its
        padding. The ops are row-invariant, so the bits are the padded forward's; padding
        cells of the result are zeros."""
        if real is not None and not bool(real.all()):
            return self._ragged(ids, positions, cache, Ragged(real))
        hidden = self.embed(ids)  # (B, T, H)
        cos, sin = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, cache)
        return self.norm(hidden)

    def _ragged(self, ids, positions, cache, ragged: Ragged) -> torch.Tensor:
        hidden = self.embed(ragged.flat(ids))  # (1, N, H)
        cos, sin = self.rotary_emb(hidden, position_ids=ragged.flat(positions))
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, cache, ragged)
        return ragged.unflatten(self.norm(hidden))

    def _layer(self, layer: _Layer, hidden, cos, sin, cache, ragged=None) -> torch.Tensor:
        residual = hidden
        x = _apply_norm(layer.input_norm, hidden)
        hidden = residual + self._attention(layer, x, cos, sin, cache, ragged)
        residual = hidden
        x = _apply_norm(layer.post_norm, hidden)
        gate = layer.silu(_apply_proj(layer.gate, x))
        return residual + _apply_proj(layer.down, gate * _apply_proj(layer.up, x))

    def _attention(self, layer: _Layer, x, cos, sin, cache, ragged=None) -> torch.Tensor:
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, layer.head_dim)
        q = _head_states(layer.q, layer.q_norm, x, hidden_shape)  # (B, Hq, T, D)
        k = _head_states(layer.k, layer.k_norm, x, hidden_shape)  # (B, Hkv, T, D)
        v = _head_states(layer.v, None, x, hidden_shape)
        q, k = layer.rotary(q, k, cos, sin)
        if ragged is not None:  # (1, heads, N, D) -> the (B, heads, T, D) layout
            q, k, v = ragged.pad_heads(q), ragged.pad_heads(k), ragged.pad_heads(v)
        keys, values, q_pos, slots = cache.update_slots(layer.index, k, v)
        out = self.attention(
            q, keys, values, q_positions=q_pos, scale=layer.scaling, kv_index=slots
        )  # (B, Hq, T, D)
        if ragged is not None:
            return _apply_proj(layer.o, ragged.flat_heads(out))
        out = out.transpose(1, 2).contiguous().reshape(*input_shape, -1).contiguous()
        return _apply_proj(layer.o, out)


class Ragged:
    """Where the real cells of a (B, T) batch are: flatten them, and put them back."""

    def __init__(self, real: torch.Tensor):
        self.shape = real.shape
        self.rows, self.cols = real.nonzero(as_tuple=True)  # (N,) row-major

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (1, N, ...)."""
        return padded[self.rows, self.cols][None]

    def unflatten(self, flat: torch.Tensor) -> torch.Tensor:
        """(1, N, H) -> (B, T, H), zeros at padding."""
        out = flat.new_zeros((*self.shape, flat.shape[-1]))
        out[self.rows, self.cols] = flat[0]
        return out

    def pad_heads(self, states: torch.Tensor) -> torch.Tensor:
        """(1, heads, N, D) -> (B, heads, T, D), zeros at padding."""
        heads, dim = states.shape[1], states.shape[-1]
        out = states.new_zeros((self.shape[0], heads, self.shape[1], dim))
        out[self.rows, :, self.cols] = states[0].transpose(0, 1)
        return out

    def flat_heads(self, out: torch.Tensor) -> torch.Tensor:
        """(B, Hq, T, D) -> (1, N, Hq * D): each token's heads concatenated."""
        return out[self.rows, :, self.cols].reshape(1, self.rows.numel(), -1)


def _head_states(proj: Proj, norm: Norm | None, x: torch.Tensor, hidden_shape) -> torch.Tensor:
    """(B, T, H) -> (B, heads, T, D): the projection split into heads, normed per head first
    where the family does (Qwen3's q_norm / k_norm)."""
    states = _apply_proj(proj, x).view(hidden_shape)
    if norm is not None:
        states = _apply_norm(norm, states)
    return states.transpose(1, 2)


def _apply_proj(proj: Proj, x: torch.Tensor) -> torch.Tensor:
    op, weight, bias = proj
    return op(x, weight, bias)


def _apply_norm(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    op, weight, eps = norm
    return op(x, weight, eps)


def fast_decoder(model: nn.Module) -> FastDecoder | None:
    """The FastDecoder of a patched dense model, or None (with one warning per reason) when
    the model has anything the plan does not know: the caller then runs the module path."""
    try:
        return _build(model)
    except UnsupportedDecoder as why:
        reason = str(why)
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("decode fast path off, the module path runs: %s", reason)
        return None


def _build(model: nn.Module) -> FastDecoder:
    handle = patch_handle(model)
    if handle is None:
        raise UnsupportedDecoder("the model is not patched")
    config = model.config
    family = family_for(config)
    prefix = DENSE_FAMILIES.get(config.model_type)
    if prefix is None or family.moe is not None:
        raise UnsupportedDecoder(f"model_type {config.model_type!r} has no fast decoder")
    _check_no_hooks(model)
    base = model.base_model
    _expect(base, f"{prefix}Model", config.model_type)
    embed, norm = base.embed_tokens, base.norm
    _expect_patched(embed, InvariantEmbedding, "embed_tokens")
    _expect_patched(norm, InvariantRMSNorm, "norm")
    rotary = _family_rotary(config.model_type)
    layers = [
        _plan_layer(layer, prefix, config, rotary)
        for layer in base.layers[: config.num_hidden_layers]
    ]
    head = (handle.ops["lm_head"], *lm_head_parameters(model))
    return FastDecoder(embed, base.rotary_emb, layers, norm, handle.ops["attention"], head, handle)


def _plan_layer(layer: nn.Module, prefix: str, config, rotary: Callable) -> _Layer:
    model_type = config.model_type
    _expect(layer, f"{prefix}DecoderLayer", model_type)
    _expect_children(layer, _LAYER_CHILDREN, "decoder layer")
    attn, mlp = layer.self_attn, layer.mlp
    _expect(attn, f"{prefix}Attention", model_type)
    _expect(mlp, f"{prefix}MLP", model_type)
    qk_norms = _QK_NORMS if hasattr(attn, "q_norm") else set()
    _expect_children(attn, _ATTENTION_CHILDREN | qk_norms, "attention")
    _expect_children(mlp, _MLP_CHILDREN, "MLP")
    if attn.training and attn.attention_dropout:
        raise UnsupportedDecoder("attention dropout in training mode")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        _expect_patched(getattr(attn, name), InvariantLinear, f"self_attn.{name}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        _expect_patched(getattr(mlp, name), InvariantLinear, f"mlp.{name}")
    for name in ("input_layernorm", "post_attention_layernorm"):
        _expect_patched(getattr(layer, name), InvariantRMSNorm, name)
    for name in qk_norms:
        _expect_patched(getattr(attn, name), InvariantRMSNorm, f"self_attn.{name}")
    if type(mlp.act_fn) is not InvariantSiLU:
        raise UnsupportedDecoder(f"mlp.act_fn is {type(mlp.act_fn).__name__}")
    return _Layer(
        index=attn.layer_idx,
        input_norm=_norm(layer.input_layernorm),
        q=_proj(attn.q_proj),
        k=_proj(attn.k_proj),
        v=_proj(attn.v_proj),
        q_norm=_norm(attn.q_norm) if qk_norms else None,
        k_norm=_norm(attn.k_norm) if qk_norms else None,
        rotary=rotary,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
        o=_proj(attn.o_proj),
        post_norm=_norm(layer.post_attention_layernorm),
        gate=_proj(mlp.gate_proj),
        up=_proj(mlp.up_proj),
        silu=mlp.act_fn.op,
        down=_proj(mlp.down_proj),
    )


def _family_rotary(model_type: str) -> Callable:
    """The apply_rotary_pos_emb the family's attention forward calls (its own module's)."""
    module = sys.modules.get(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = getattr(module, "apply_rotary_pos_emb", None)
    if rotary is None:
        raise UnsupportedDecoder(f"transformers' {model_type} module has no apply_rotary_pos_emb")
    return rotary


def _expect(module: nn.Module, class_name: str, model_type: str) -> None:
    """The family's own HF class (not a subclass: its forward is the one this plan copies)."""
    cls = type(module)
    where = f"transformers.models.{model_type}.modeling_{model_type}"
    if cls.__name__ != class_name or cls.__module__ != where:
        raise UnsupportedDecoder(f"{cls.__module__}.{cls.__name__} is not {where}.{class_name}")


def _expect_children(module: nn.Module, names: set[str], what: str) -> None:
    children = {name for name, _ in module.named_children()}
    if children != names:
        raise UnsupportedDecoder(f"the {what} holds {sorted(children)}, not {sorted(names)}")


def _expect_patched(module: nn.Module, cls: type, name: str) -> None:
    """Exactly the patched module (a LoRA or tensor-parallel wrapper is not), on its device."""
    if type(module) is not cls:
        raise UnsupportedDecoder(f"{name} is {type(module).__name__}, not {cls.__name__}")
    check_patched_device(module, module.weight)


def _check_no_hooks(model: nn.Module) -> None:
    """Hooks observe or change module calls the fast path does not make."""
    from torch.nn.modules import module as torch_module

    if any(
        getattr(torch_module, name)
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
    ):
        raise UnsupportedDecoder("global module forward hooks are registered")
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            raise UnsupportedDecoder(f"module {name or '<model>'} has forward hooks")
