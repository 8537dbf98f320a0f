"""vLLM's flat token batch as the padded batch the patched model runs, and vLLM's paged
KV cache as the `rl_kv_cache` the patched attention hook reads and writes.

vLLM hands the model all scheduled tokens flattened, request after request
(`query_start_loc`), each with its position. The patched Hugging Face model takes
rows instead: `FlatBatch` scatters the tokens into (requests, longest query)
with position -1 on padding, and gathers the hidden states back. Every op of the
patched model is row-invariant, so a token's bits do not depend on that layout.

`PagedKVCache` implements the hook's cache protocol (rl_engine.patching.attention):

    update(layer_idx, key, value) -> (keys, values, q_positions)

It writes each real token's key/value into vLLM's cache at its slot
(`slot_mapping`), then gathers every request's blocks (`block_table`) into the
aligned layout: row b, slot j = position j of request b, zeros past its
length. The attention op then reduces each query over its own sequence in
128-position blocks from position 0, so prefill, decode, chunked prefill and
prefix-cached blocks give one result. The cache is vLLM's CPU layout
([blocks, kv_heads, block, 2 * head]: the block's keys, then its values), in
the model dtype; only this module reads what it writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.rollout.vllm.checks import check_attention_metadata

PAD_ID = 0


@dataclass(frozen=True)
class FlatBatch:
    """Where each of vLLM's flat tokens sits in the padded (requests, longest query) batch."""

    rows: torch.Tensor
    """(N,) int64: the request of each real token."""
    cols: torch.Tensor
    """(N,) int64: its column (index within the request's scheduled query)."""
    q_positions: torch.Tensor
    """(B, T) int64: each padded cell's sequence position, -1 = padding."""

    @classmethod
    def from_metadata(cls, metadata, positions: torch.Tensor) -> FlatBatch:
        starts = metadata.query_start_loc.long()  # (B + 1,)
        count = int(metadata.num_actual_tokens)
        lengths = starts[1:] - starts[:-1]  # (B,)
        requests = lengths.numel()
        rows = torch.repeat_interleave(torch.arange(requests), lengths)  # (N,)
        cols = torch.arange(count) - starts[rows]
        q_positions = torch.full((requests, int(lengths.max())), -1, dtype=torch.long)
        q_positions[rows, cols] = positions[:count].long()
        return cls(rows, cols, q_positions)

    @property
    def count(self) -> int:
        return self.rows.numel()

    def pad_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids: the real tokens in their cells, PAD_ID elsewhere."""
        ids = torch.full(self.q_positions.shape, PAD_ID, dtype=torch.long)
        ids[self.rows, self.cols] = input_ids[: self.count].long()
        return ids

    def flat(self, padded: torch.Tensor, total: int) -> torch.Tensor:
        """(B, T, ...) -> (total, ...): the real tokens in vLLM's order, zeros after them."""
        out = padded.new_zeros((total, *padded.shape[2:]))
        out[: self.count] = padded[self.rows, self.cols]
        return out


class PagedKVCache:
    """One forward's view of vLLM's paged KV cache, for the patched attention hook."""

    def __init__(self, layer_names: list[str], batch: FlatBatch):
        self.layer_names, self.batch = layer_names, batch

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key/value (B, Hkv, T, D) of this forward's padded batch -> the batch's keys and
        values (B, Hkv, L, D) in aligned layout and q_positions (B, T)."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        name = self.layer_names[layer_idx]
        metadata, _, kv_cache, _ = get_attention_context(name)
        check_attention_metadata(name, metadata)
        key_cache, value_cache = split_kv_cache(kv_cache)
        slots = metadata.slot_mapping[: self.batch.count].long()
        self._write(key_cache, key, slots)
        self._write(value_cache, value, slots)
        seq_lens = metadata.seq_lens.long()
        blocks = metadata.block_table[:, : _blocks_needed(seq_lens, key_cache.shape[2])].long()
        keys = _gather(key_cache, blocks, seq_lens)
        values = _gather(value_cache, blocks, seq_lens)
        return keys, values, self.batch.q_positions

    def _write(self, cache: torch.Tensor, padded: torch.Tensor, slots: torch.Tensor) -> None:
        """Each real token's (Hkv, D) row into block slot // block, offset slot % block."""
        block = cache.shape[2]
        tokens = padded[self.batch.rows, :, self.batch.cols]  # (N, Hkv, D)
        cache[slots // block, :, slots % block] = tokens.to(cache.dtype)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, Hkv, block, 2D] -> key and value views [blocks, Hkv, block, D] (vLLM's CPU
    split: the block's keys, then its values)."""
    blocks, heads, block, _ = kv_cache.shape
    both = kv_cache.view(blocks, heads, 2 * block, -1)
    return both[:, :, :block], both[:, :, block:]


def _blocks_needed(seq_lens: torch.Tensor, block: int) -> int:
    return int((seq_lens.max() + block - 1) // block)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, n * block, D): request b's blocks in order, zeros at positions >= its length
    (table entries past a request's blocks point anywhere)."""
    requests, count = blocks.shape
    _, heads, block, dim = cache.shape
    picked = cache[blocks]  # (B, n, Hkv, block, D)
    aligned = picked.permute(0, 2, 1, 3, 4).reshape(requests, heads, count * block, dim)
    past_end = torch.arange(count * block)[None, :] >= seq_lens[:, None]  # (B, L)
    return aligned.masked_fill(past_end[:, None, :, None], 0)
