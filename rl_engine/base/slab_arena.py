"""Long-lived small CPU tensors packed into large slabs, so that they never fragment the heap.

glibc serves a CPU tensor below its mmap threshold (which rises to 32 MiB after the first
large free) from its heap, and keeps a freed chunk resident there while any chunk above it
lives. The layout-invariant backward keeps one fp32 partial per parameter (the sink's tree
nodes, 1-4 MiB each for SmolLM2) from a mini-batch's first micro-batch to its update, while
thousands of short-lived tensors come and go around them: the heap grows around the
long-lived ones and stays grown. A slab of `SLAB_BYTES` is above any mmap threshold, so it
gets pages of its own, and when its last tensor is released the pages go back to the OS.

Measured (SmolLM2-135M, 2 ZeRO-3 ranks, bf16, `rl-engine bench train --case layout`): see
docs/benchmarks.md.
"""

from __future__ import annotations

import torch

SLAB_BYTES = 64 << 20
ALIGN_BYTES = 64  # a cache line: a slot's rows start where a fresh tensor's would


class SlabArena:
    """Slots carved from slabs of `SLAB_BYTES`, one slab chain per dtype; a slab is dropped
    when every slot carved from it has been released. CPU tensors of at most a quarter slab
    only: anything larger is mmapped by the allocator already (`adopt` returns it as it is)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES):
        self.slab_bytes = slab_bytes
        self._open: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # dtype -> (slab, used)
        self._live: dict[int, int] = {}  # slab data_ptr -> slots not yet released
        self._slabs: dict[int, torch.Tensor] = {}

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values in a slot of a slab (a view shaped as `tensor`), or `tensor` itself
        when it is not a small contiguous CPU tensor. The caller gives `tensor` up."""
        size = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or size == 0 or 4 * size > self.slab_bytes:
            return tensor
        slab, used = self._open.get(tensor.dtype, (None, self.slab_bytes))
        if used + size > self.slab_bytes:
            slab, used = torch.empty(self.slab_bytes, dtype=torch.uint8), 0
            self._slabs[slab.data_ptr()] = slab
            self._live[slab.data_ptr()] = 0
        slot = slab[used : used + size].view(tensor.dtype).view(tensor.shape)
        slot.copy_(tensor)
        self._open[tensor.dtype] = (slab, used + -(-size // ALIGN_BYTES) * ALIGN_BYTES)
        self._live[slab.data_ptr()] += 1
        return slot

    def release(self, slot: torch.Tensor) -> None:
        """A slot given by `adopt` is no longer used (no-op for a tensor `adopt` returned as it
        was). The caller drops its references to the slot too."""
        base = slot.untyped_storage().data_ptr()
        if base not in self._live:
            return
        self._live[base] -= 1
        if self._live[base] == 0:
            del self._live[base]
            slab = self._slabs.pop(base)
            self._open = {d: (s, u) for d, (s, u) in self._open.items() if s is not slab}

    @property
    def slabs(self) -> int:
        """How many slabs are alive."""
        return len(self._slabs)
