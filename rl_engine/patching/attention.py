"""Hugging Face attention hook: routes every attention call to the invariant op.

Registered in transformers' attention-function registry under one name per
backend (`attention_name(backend)`, e.g. "rl_engine_invariant_triton"), bound to
the attention op `apply_batch_invariant` resolved for that backend, together
with a mask function of the same name that hands the attention the 2-D padding
mask (the invariant op needs each token's position in its sequence, not a 4-D
additive mask).

Three ways keys arrive:
- a plain forward (trainer, HF `generate` with its own cache): keys are the
  padded batch; positions come from the padding mask (cumsum - 1);
- a packed forward: each row holds several sequences one after another. The
  forward carries `rl_packed=PackedSegments(positions, segments)` (each token's
  position in its own sequence, -1 = padding, and its sequence id in the row),
  or, without that kwarg, no attention mask and `position_ids` that restart at
  0 for every sequence (transformers' own packed format: a sequence starts
  wherever a position is not its predecessor + 1). The op then gets
  `q_segments` / `k_segments`: a token attends only to its own sequence. With
  `rl_kv_cache` too (the rollout engine's packed prefill) the keys are also
  stored: `cache.store(layer_idx, key, value)`;
- a forward that carries `rl_kv_cache=<cache>` (the rollout engine): the cache
  stores keys at slot == position and reports each query's position. Protocol:
  `cache.update(layer_idx, key, value) -> (keys, values, q_positions)` with keys
  and values (B, Hkv, L, D) in aligned layout and q_positions (B, Tq) int64.
  A cache that also has `update_slots(layer_idx, key, value) -> (keys, values,
  q_positions, slots)` (keys (S, Hkv, L, D) for all its slots, slots (B,) int64)
  is used through that instead, and the op reads row b's keys at keys[slots[b]]
  (its `kv_index`) without a gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ATTENTION_PREFIX = "rl_engine_invariant"
KV_CACHE_KWARG = "rl_kv_cache"
PACKED_KWARG = "rl_packed"


@dataclass(frozen=True)
class PackedSegments:
    """The `rl_packed` forward kwarg: which sequence each token of a packed batch belongs to."""

    positions: torch.Tensor
    """(R, N) int64: each token's position in its own sequence (from 0); -1 = padding."""
    segments: torch.Tensor
    """(R, N) int64: the id of each token's sequence within its row (padding: any value)."""

    def __post_init__(self) -> None:
        for name in ("positions", "segments"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.long:
                raise ValueError(f"PackedSegments.{name} must be an int64 (R, N) tensor")
        if self.positions.shape != self.segments.shape:
            raise ValueError(
                f"PackedSegments.positions {tuple(self.positions.shape)} and segments "
                f"{tuple(self.segments.shape)} must have the same shape"
            )

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSegments:
        """transformers' packed format: a sequence starts where a position is not its
        predecessor + 1, and every sequence must start at position 0."""
        pos = position_ids.long()
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        bad = starts & (pos != 0)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"position_ids: a packed sequence starts at position {int(pos[row, col])} "
                f"(row {row}, column {col}); every packed sequence must start at 0"
            )
        return cls(pos, starts.long().cumsum(-1))


def attention_name(backend: str) -> str:
    """transformers' attn_implementation name of the invariant attention of `backend`."""
    return f"{ATTENTION_PREFIX}_{backend}"


def invariant_attention_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """Mask function for our attention name: the 2-D bool padding mask, or None if nothing is padded."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    mask = attention_mask[:, -kv_length:].to(torch.bool)  # (B, Tk)
    return None if bool(mask.all()) else mask


def positions_from_mask(mask, batch_size, q_length, kv_length, device):
    """(q_positions (B, Tq), k_positions (B, Tk) or None) from a 2-D padding mask."""
    if mask is None:  # nothing padded: key j is position j, queries are the last Tq keys
        q_pos = torch.arange(kv_length - q_length, kv_length, device=device)
        return q_pos.expand(batch_size, q_length), None
    if mask.dim() != 2 or mask.shape != (batch_size, kv_length):
        raise ValueError(
            f"invariant attention needs a 2-D padding mask of shape ({batch_size}, {kv_length}), "
            f"got {tuple(mask.shape)}; 4-D custom masks (packed sequences, sliding windows) are not supported"
        )
    k_pos = mask.long().cumsum(-1) - 1  # (B, Tk)
    k_pos = k_pos.masked_fill(~mask, -1)
    return k_pos[:, kv_length - q_length :], k_pos


def invariant_attention_forward(
    attend: Callable, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs
):
    """HF attention interface with the op `attend` bound first (see `register_attention`):
    q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) -> ((B, Tq, Hq, D), None)."""
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported with batch-invariant kernels "
            "(set the model config's attention_dropout to 0)"
        )
    cache = kwargs.get(KV_CACHE_KWARG)
    packed = _packed_segments(query, key, attention_mask, cache, kwargs)
    if packed is not None:
        if cache is not None:  # the engine's packed prefill: keep the keys for decoding
            cache.store(module.layer_idx, key, value)
        pos, seg = packed.positions, packed.segments
        out = attend(
            query,
            key,
            value,
            q_positions=pos,
            k_positions=pos,
            scale=scaling,
            q_segments=seg,
            k_segments=seg,
        )
    elif cache is not None and hasattr(cache, "update_slots"):
        key, value, q_pos, slots = cache.update_slots(module.layer_idx, key, value)
        out = attend(query, key, value, q_positions=q_pos, scale=scaling, kv_index=slots)
    elif cache is not None:
        key, value, q_pos = cache.update(module.layer_idx, key, value)
        out = attend(query, key, value, q_positions=q_pos, k_positions=None, scale=scaling)
    else:
        batch, _, q_len, _ = query.shape
        q_pos, k_pos = positions_from_mask(attention_mask, batch, q_len, key.shape[2], query.device)
        out = attend(query, key, value, q_positions=q_pos, k_positions=k_pos, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _packed_segments(query, key, attention_mask, cache, kwargs) -> PackedSegments | None:
    """The packed layout of this forward: the `rl_packed` kwarg, or transformers' packed
    format (no mask, no cache, position_ids that restart); None for any other forward."""
    packed = kwargs.get(PACKED_KWARG)
    batch, _, q_len, _ = query.shape
    if packed is not None:
        if cache is not None and not hasattr(cache, "store"):
            raise ValueError(
                f"{PACKED_KWARG} with {KV_CACHE_KWARG}: the cache must have store(layer_idx, "
                "key, value) (a packed forward attends to its own keys and only stores them)"
            )
        if not isinstance(packed, PackedSegments):
            raise ValueError(
                f"{PACKED_KWARG} must be a PackedSegments, got {type(packed).__name__}"
            )
        if tuple(packed.positions.shape) != (batch, q_len) or key.shape[2] != q_len:
            raise ValueError(
                f"{PACKED_KWARG} covers {tuple(packed.positions.shape)} tokens, but the forward "
                f"has {batch} rows of {q_len} queries and {key.shape[2]} keys"
            )
        return packed
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or cache is not None or position_ids is None:
        return None
    if key.shape[2] != q_len or position_ids.shape[-1] != q_len:
        return None
    pos = position_ids.expand(batch, q_len)
    if not bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
        return None  # one sequence per row: the plain path
    return PackedSegments.from_position_ids(pos)


def register_attention(backend: str, attend: Callable) -> str:
    """Make `attention_name(backend)` a valid `attn_implementation` calling `attend`; returns the name.

    `attend` is the backend's attention op as `get_op` resolved it; one backend
    has one attention function for every device, so re-registering is idempotent.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return invariant_attention_forward(
            attend, module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )

    forward.__qualname__ = f"invariant_attention_forward[{backend}]"
    name = attention_name(backend)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, invariant_attention_mask)
    return name


# ----------------------------------------------------------------------------- invariance off

PLAIN_CACHED_NAME = "rl_engine_plain_cached"


def plain_cached_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs
):
    """Invariance OFF: plain SDPA, over the rollout engine's KV cache when `rl_kv_cache` is given.

    With a cache: q (B, Hq, Tq, D) attends causally to the cache's aligned keys
    (slot j = position j) through a boolean mask; padding queries (position -1)
    get a throw-away row. Without one it is transformers' own sdpa attention.
    Not batch-invariant: it exists so that the engine can run unpatched models
    (benchmarks, mismatch diagnostics). Returns ((B, Tq, Hq, D), None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = kwargs.pop(KV_CACHE_KWARG, None)
    if cache is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    key, value, q_pos = cache.update(module.layer_idx, key, value)  # (B, Hkv, L, D), (B, Tq)
    kv_len = int(q_pos.max()) + 1
    key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    slots = torch.arange(kv_len, device=query.device)
    allowed = slots[None, None, :] <= q_pos.clamp(min=0)[:, :, None]  # (B, Tq, L)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=allowed[:, None],
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )  # (B, Hq, Tq, D)
    return out.transpose(1, 2).contiguous(), None


def register_plain_cached_attention() -> None:
    """Make `PLAIN_CACHED_NAME` a valid `attn_implementation` (idempotent); masks as for sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PLAIN_CACHED_NAME, plain_cached_attention_forward)
    AttentionMaskInterface.register(PLAIN_CACHED_NAME, sdpa_mask)
