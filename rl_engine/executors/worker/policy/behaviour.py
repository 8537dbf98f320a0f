"""Behaviour versions: the weights the engines sample with while the ranks train (asynchronous RL).

Under `rollout.max_staleness` k >= 1 the engines generate a later step's rollouts with weight
version v while this rank trains from v to v+1. Before the update, `VersionSnapshot.take` keeps
this rank's copy of the trainable parameters at v: under ZeRO-3 its partition
(`param.ds_tensor`, what the weight sync sends), else the whole tensor; frozen parameters never
change, so a LoRA policy keeps only its adapters. After the update, `swapped_in` copies v back
into place for a no-grad forward and restores the live weights after it, so the trainer scores
the engines' rollouts with the very bits that sampled them (`verify_behaviour`), and the parity
check of a stale sample is bitwise like any other.

One snapshot lives at a time: the rollouts of version v are all generated while the ranks train
from v, so they are checked before the next step, and a sample reaches the loss with its check
done, whatever its staleness. Memory: one copy of the trainable parameters in the trained dtype
(under ZeRO-3, of this rank's partition); time: a no-grad forward of every stale sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


def _holders(module: nn.Module) -> list[torch.Tensor]:
    """The tensors that hold this rank's share of every trainable parameter."""
    held = []
    for param in module.parameters():  # tied parameters once
        if not param.requires_grad:
            continue
        part = getattr(param, "ds_tensor", None)  # ZeRO-3: this rank's partition
        if part is not None:
            held.append(part.data)
        if part is None or param.data.numel() > 0:  # ZeRO-3 keeps small ones gathered too
            held.append(param.data)
    return held


@dataclass(frozen=True, slots=True)
class VersionSnapshot:
    """This rank's trainable weights at `version`, as the engines received them."""

    version: int
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    @torch.no_grad()
    def take(cls, module: nn.Module, version: int) -> VersionSnapshot:
        return cls(version, tuple(t.detach().clone() for t in _holders(module)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[None]:
        """`module` computes with this snapshot's weights inside the block (copied in place, so
        every optimizer and ZeRO reference stays valid), with its own weights after it."""
        holders = _holders(module)
        if [t.shape for t in holders] != [t.shape for t in self.tensors]:
            raise RuntimeError("the policy's trainable parameters changed shape since the snapshot")
        with torch.no_grad():
            live = [t.clone() for t in holders]
            for held, old in zip(holders, self.tensors):
                held.copy_(old)
        try:
            yield
        finally:
            with torch.no_grad():
                for held, mine in zip(holders, live):
                    held.copy_(mine)
