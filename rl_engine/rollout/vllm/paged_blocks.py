"""vLLM's paged KV cache read in place: the `update_slots` cache of `FastDecoder`.

`FastDecoder` (patching/decode_path.py) calls, once per layer,

    cache.update_slots(layer_idx, key, value) -> (keys, values, q_positions, kv_index)

and hands `kv_index` to the attention op. Here `keys` / `values` are the layer's vLLM cache
halves as (blocks, Hkv, block, D) views and `kv_index` the batch's block table (B, n): the
cpp attention reads each request's keys from its blocks in place (no gather) and packs them
into the 16-key blocks it packs from an aligned row, so the bits are those of the gathered
path (paged.py's `PagedKVCache`; tests/kernels/cpp/test_paged_attention.py). Writing is
paged.py's: each real token's key/value at its vLLM slot, in the model dtype.

Only a backend whose attention reads block tables may take it (cpp; `BLOCK_TABLE_BACKENDS`):
native and triton refuse a block table with a named error, never a quiet gather.
"""

from __future__ import annotations

import torch

from rl_engine.rollout.vllm.checks import check_attention_metadata
from rl_engine.rollout.vllm.paged import FlatBatch, split_kv_cache

BLOCK_TABLE_BACKENDS = ("cpp",)
"""Attention backends that read kv_index as a block table (the others raise)."""


class PagedBlockCache:
    """One forward's view of vLLM's paged KV cache, for FastDecoder's `update_slots`."""

    def __init__(self, layer_names: list[str], batch: FlatBatch):
        self.layer_names, self.batch = layer_names, batch
        self._metadata = None  # the last layer's metadata and what it gave (one group: shared)
        self._slots = self._table = None

    def update_slots(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key/value (B, Hkv, T, D) of this forward's padded batch -> the layer's cache halves
        (blocks, Hkv, block, D), q_positions (B, T) and the block table (B, n) int64."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        name = self.layer_names[layer_idx]
        metadata, _, kv_cache, _ = get_attention_context(name)
        if metadata is not self._metadata:
            check_attention_metadata(name, metadata)
            self._heads = kv_cache.shape[1]
            self._bind(metadata, kv_cache.shape[2])
        key_cache, value_cache = split_kv_cache(kv_cache)
        if kv_cache.is_contiguous():
            rows = kv_cache.view(-1, kv_cache.shape[-1] // 2)  # (blocks * Hkv * 2 block, D)
            rows.index_copy_(0, self._key_rows, self._tokens(key, kv_cache.dtype))
            rows.index_copy_(
                0, self._key_rows + kv_cache.shape[2], self._tokens(value, kv_cache.dtype)
            )
        else:  # the same copy through advanced indexing (slower)
            self._write(key_cache, key)
            self._write(value_cache, value)
        return key_cache, value_cache, self.batch.q_positions, self._table

    def _bind(self, metadata, block: int) -> None:
        slots = metadata.slot_mapping[: self.batch.count].long()
        self._slots = (slots // block, slots % block)
        heads = self._heads
        # row of token n's key, head h in the cache viewed as (blocks * Hkv * 2 block, D)
        first = (self._slots[0] * heads)[:, None] + torch.arange(heads)[None, :]
        self._key_rows = (first * 2 * block + self._slots[1][:, None]).reshape(-1)
        seq_lens = metadata.seq_lens.long()
        needed = int((seq_lens.max() + block - 1) // block)
        self._table = metadata.block_table[:, :needed].long().contiguous()
        self._metadata = metadata

    def _tokens(self, padded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(N * Hkv, D): each real token's heads, in the order of the rows bound."""
        tokens = padded[self.batch.rows, :, self.batch.cols]  # (N, Hkv, D)
        return tokens.reshape(-1, tokens.shape[-1]).to(dtype)

    def _write(self, cache: torch.Tensor, padded: torch.Tensor) -> None:
        """Each real token's (Hkv, D) row into its block and offset."""
        blocks, offsets = self._slots
        tokens = padded[self.batch.rows, :, self.batch.cols]  # (N, Hkv, D)
        cache[blocks, :, offsets] = tokens.to(cache.dtype)
