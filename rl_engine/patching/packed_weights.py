"""Packed copies of a patched model's GEMM weights, for the engine's forward-only fast path.

The cpp backend's GEMM reads a weight as panels; packing them on every call costs more
than the product at decode sizes. A backend that can keep them packed says so in its
layout (`BackendLayout.weight_packing`); `FastDecoder` then runs its projections and its
LM head on packed copies (decode_path.py), with the bits of the unpacked ops.

Where the copies live and when they are made (the rule that keeps them never stale):
- one `PackedWeights` per `RolloutEngine`, with a buffer per weight tensor. Every
  `generate` / `generate_episodes` call packs every weight into its buffer when the call's
  FastDecoder is built, so a call always reads the weights as they are at its start: a
  weight sync, a `load_weights` or any in-place change between calls is seen, however it
  was written (a tensor's version counter does not see writes through `.data`, so nothing
  here relies on it). During a call nothing writes them: the engine's weight syncs and
  `load_weights` run between calls, on the thread that calls `generate` (the Ray rollout
  actor runs one method at a time).
- the buffers are kept between calls (about the model's size again: 1 GB for the 0.5B
  shape in bf16): allocating them afresh costs three to four times the packing itself
  (page faults; docs/benchmarks.md). `release` frees them: the engine's `release_weights`
  does (a full-weight job's engines between their generate and the next sync, while the
  trainer ranks hold their peak), and so does `RolloutEngine.release_packed_weights`.
- the trainer never reads these copies: only the engine's no-grad FastDecoder does, and the
  packed projection refuses an input that wants a gradient.
"""

from __future__ import annotations

import weakref

import torch

from rl_engine.kernels import WeightPacking


class PackedWeights:
    """Packed weights, keyed by the weight tensor (the Parameter object); repacked by each call."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def pack(self, weight: torch.Tensor, packing: WeightPacking):
        """`weight` packed now (into its buffer when it was packed before and not released)."""
        key = id(weight)
        entry = self._entries.get(key)
        old = None
        if entry is not None and entry[0]() is weight:
            old = entry[1]
            if (old.out_features, old.in_features, old.dtype) != (*weight.shape, weight.dtype):
                old = None  # the parameter was reshaped or cast: a new buffer
        packed = packing.pack(weight, into=old)
        self._entries[key] = (weakref.ref(weight), packed)
        self._drop_dead()
        return packed

    def release(self) -> None:
        """Drop every packed copy: the buffers are freed once no FastDecoder holds them (a
        call's decoder lives for the call), and the next pack allocates new ones."""
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies of the weights that are still alive."""
        self._drop_dead()
        return sum(packed.nbytes for _, packed in self._entries.values())

    def _drop_dead(self) -> None:
        dead = [key for key, (ref, _) in self._entries.items() if ref() is None]
        for key in dead:
            del self._entries[key]
