"""Hugging Face attention hook: routes every attention call to the invariant op.

Registered in transformers' attention-function registry under one name per
backend (`attention_name(backend)`, e.g. "rl_engine_invariant_triton"), bound to
the attention op `apply_batch_invariant` resolved for that backend, together
with a mask function of the same name that hands the attention the 2-D padding
mask (the invariant op needs each token's position in its sequence, not a 4-D
additive mask).

Two ways keys arrive:
- a plain forward (trainer, HF `generate` with its own cache): keys are the
  padded batch; positions come from the padding mask (cumsum - 1);
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

import torch

ATTENTION_PREFIX = "rl_engine_invariant"
KV_CACHE_KWARG = "rl_kv_cache"


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
    if cache is not None and hasattr(cache, "update_slots"):
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
