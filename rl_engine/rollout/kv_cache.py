"""Slot KV cache of the rollout engine, in the aligned layout the attention hook expects.

Each running sequence owns a slot; in a slot, cache row j holds the key/value of
sequence position j ("aligned layout"). Before every forward the engine binds
the batch: which slot each batch row uses and the position of each of its
query tokens. The attention hook (`rl_engine.patching.attention`) then calls,
once per layer,

    cache.update(layer_idx, key, value) -> (keys, values, q_positions)

which writes the new keys/values at their positions and returns the batch's
keys/values (B, Hkv, L, D) with slot j = position j, plus q_positions (B, Tq)
(negative = padding query). Rows past a sequence's length hold stale but
finite values (zeros, or an earlier sequence's keys): the causal attention
never reads them, and the invariant op requires only that they are finite.

The invariant hook uses the cheaper variant

    cache.update_slots(layer_idx, key, value) -> (keys, values, q_positions, slots)

which returns the whole (num_slots, Hkv, capacity, D) buffers and each batch
row's slot (B,), with no gather: the attention op reads them in place through
its `kv_index` argument when they are contiguous, in its compute dtype (pass
`dtype=torch.float32`) and `capacity` is a multiple of its key block (pass
`block=BLOCK_K`; the capacity is rounded up).

A packed prefill (several prompts concatenated in one row, `rl_engine.logprobs.packing`)
binds with `bind_packed(token_slots, positions)`: every token names its own slot.
Its attention runs on the packed keys themselves (segment-aware), so the hook
only stores them: `cache.store(layer_idx, key, value)`.

Between forwards, `copy_rows(source, targets, length)` copies positions [0, length) of one
slot into others, in every layer: how samples of one prompt share its prefill (the rows a
prefill writes depend on the prompt alone, so a copy has the bits a prefill of its own
would write).
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Per-layer (slots, Hkv, capacity, D) key and value buffers, allocated at first use."""

    def __init__(
        self,
        num_slots: int,
        capacity: int,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        block: int = 1,
    ):
        """dtype: storage dtype (None = the keys' own); capacity is rounded up to a multiple of block."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        capacity = -(-capacity // block) * block
        self.num_slots, self.capacity, self.device = num_slots, capacity, torch.device(device)
        self.dtype = dtype
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._bound = False

    def bind(self, slots: torch.Tensor, q_positions: torch.Tensor) -> None:
        """Set the batch of the next forward: slots (B,) int64, q_positions (B, Tq) int64, -1 = padding."""
        if slots.dim() != 1 or q_positions.dim() != 2 or q_positions.shape[0] != slots.shape[0]:
            raise ValueError(
                f"slots must be (B,) and q_positions (B, Tq), got {tuple(slots.shape)} and {tuple(q_positions.shape)}"
            )
        max_pos = int(q_positions.max())
        if max_pos >= self.capacity:
            raise ValueError(
                f"q_positions reach {max_pos}, but the cache holds {self.capacity} positions"
            )
        self._slots, self._q_positions = slots, q_positions
        self._kv_len = max_pos + 1  # keys any query of this batch may read
        rows, cols = (q_positions >= 0).nonzero(as_tuple=True)  # (N,) tokens to write
        self._write = (rows, cols, slots[rows], q_positions[rows, cols])
        first = int(slots[0])
        expected = torch.arange(first, first + slots.shape[0], device=slots.device)
        self._slot_range = (first, first + slots.shape[0]) if torch.equal(slots, expected) else None
        self._bound = True

    def bind_packed(self, token_slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Set a packed forward: token_slots and positions (R, N) int64, -1 = padding.

        The forward only stores its keys and values (`store`); reading the cache back
        (`update`, `update_slots`) is for padded and decode forwards.
        """
        if token_slots.shape != positions.shape or positions.dim() != 2:
            raise ValueError(
                f"token_slots and positions must be (R, N) of one shape, got "
                f"{tuple(token_slots.shape)} and {tuple(positions.shape)}"
            )
        max_pos = int(positions.max())
        if max_pos >= self.capacity:
            raise ValueError(
                f"positions reach {max_pos}, but the cache holds {self.capacity} positions"
            )
        rows, cols = (positions >= 0).nonzero(as_tuple=True)
        self._write = (rows, cols, token_slots[rows, cols], positions[rows, cols])
        self._slots = self._q_positions = None  # nothing to read back
        self._packed_rows = (token_slots, positions)
        self._bound = True

    def unbind(self) -> None:
        self._bound = False

    def copy_rows(self, source: int, targets: list[int], length: int) -> None:
        """Copy the keys and values of positions [0, length) of slot `source` into each slot of
        `targets`, in every layer (between forwards; the source must have been written)."""
        if self._bound:
            raise RuntimeError("SlotKVCache.copy_rows called inside a bound forward")
        if not self._keys:
            raise RuntimeError("SlotKVCache.copy_rows: no forward has written the cache yet")
        slots = [source, *targets]
        if len(set(slots)) != len(slots) or not all(0 <= s < self.num_slots for s in slots):
            raise ValueError(
                f"copy_rows needs distinct slots in [0, {self.num_slots}), got source {source} "
                f"and targets {targets}"
            )
        if not 1 <= length <= self.capacity:
            raise ValueError(f"length must be in [1, {self.capacity}], got {length}")
        index = torch.tensor(targets, device=self.device)
        for buffers in (self._keys, self._values):
            for buf in buffers.values():  # (S, Hkv, capacity, D)
                buf[index, :, :length] = buf[source, :, :length]

    def bound(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots (B,), q_positions (B, Tq)) of the forward being run: which sequence and position
        each row of its batch is (the diagnostics' routing trace reads it); a packed forward
        gives each token's slot, (R, N) like its positions (-1 = padding)."""
        if not self._bound:
            raise RuntimeError("SlotKVCache.bound() called outside a bound forward")
        if self._slots is None:
            return self._packed_rows
        return self._slots, self._q_positions

    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store key/value (R, Hkv, N, D) of the bound forward (packed: `bind_packed`)."""
        self._store(layer_idx, key, value)

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """Store key/value (B, Hkv, Tq, D); return (keys, values) (B, Hkv, L, D) and q_positions (B, Tq)."""
        self._check_readable()
        k_buf, v_buf = self._store(layer_idx, key, value)
        return self._gather(k_buf), self._gather(v_buf), self._q_positions

    def update_slots(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """Store key/value (B, Hkv, Tq, D); return the whole buffers (S, Hkv, capacity, D),
        q_positions (B, Tq) and the slot of every batch row (B,): no copy."""
        self._check_readable()
        k_buf, v_buf = self._store(layer_idx, key, value)
        return k_buf, v_buf, self._q_positions, self._slots

    def _store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        if not self._bound:
            raise RuntimeError(
                "SlotKVCache.update called outside a bound forward (call bind() first)"
            )
        k_buf, v_buf = self._buffers(layer_idx, key)
        rows, cols, w_slots, w_pos = self._write
        k_buf[w_slots, :, w_pos] = key[rows, :, cols].to(k_buf.dtype)  # (N, Hkv, D)
        v_buf[w_slots, :, w_pos] = value[rows, :, cols].to(v_buf.dtype)
        return k_buf, v_buf

    def _check_readable(self) -> None:
        if self._bound and self._slots is None:
            raise RuntimeError("a packed forward (bind_packed) stores keys only: call store()")

    def _gather(self, buf: torch.Tensor) -> torch.Tensor:
        buf = buf[:, :, : self._kv_len]  # (S, Hkv, L, D) view
        if self._slot_range is not None:
            return buf[self._slot_range[0] : self._slot_range[1]]  # a view: no copy
        return buf.index_select(0, self._slots)

    def _buffers(self, layer_idx: int, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self._keys:
            _, heads, _, head_dim = key.shape
            shape = (self.num_slots, heads, self.capacity, head_dim)
            # zeros, not empty(): unwritten rows must be finite for the attention op
            dtype = key.dtype if self.dtype is None else self.dtype
            self._keys[layer_idx] = torch.zeros(shape, dtype=dtype, device=self.device)
            self._values[layer_idx] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._keys[layer_idx], self._values[layer_idx]
