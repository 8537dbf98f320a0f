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


def _shares(module: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, the tensor holding this rank's share of it) for every trainable parameter:
    its ZeRO-3 partition (`ds_tensor`), else the parameter itself."""
    shares = []
    for param in module.parameters():  # tied parameters once
        if param.requires_grad:
            part = getattr(param, "ds_tensor", None)
            shares.append((param, param.data if part is None else part.data))
    return shares


def _gathered(params: list[nn.Parameter], parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole values of ZeRO-3 `params` from every rank's partition in `parts` (rank r holds
    flat elements [r p, (r + 1) p) of each): one all-gather for all of them, on every rank."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in parts]) if parts else torch.empty(0)
    pieces = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, flat)
    whole, offset = [], 0
    for param, part in zip(params, parts):
        n = part.numel()
        full = torch.cat([piece[offset : offset + n] for piece in pieces])
        whole.append(full[: param.numel()].view_as(param.data))
        offset += n
    return whole


def _held_whole(param: nn.Parameter) -> bool:
    """A ZeRO-3 parameter gathered between forwards (a small, persistent one)."""
    return hasattr(param, "ds_tensor") and param.data.numel() > 0


@dataclass(frozen=True, slots=True)
class VersionSnapshot:
    """This rank's trainable weights at `version`, as the engines received them."""

    version: int
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    @torch.no_grad()
    def take(cls, module: nn.Module, version: int) -> VersionSnapshot:
        return cls(version, tuple(share.detach().clone() for _, share in _shares(module)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[None]:
        """`module` computes with this snapshot's weights inside the block (copied in place, so
        every optimizer and ZeRO reference stays valid), with its own weights after it.

        Under ZeRO-3 the partitions are swapped, and a parameter ZeRO-3 holds whole between
        forwards (a small, persistent one) gets its whole value gathered from the snapshot's
        partitions: collective, like the forward itself."""
        shares = _shares(module)
        now, then = [t.shape for _, t in shares], [t.shape for t in self.tensors]
        if now != then:
            raise RuntimeError(
                f"the policy's trainable parameters changed since the snapshot of version "
                f"{self.version}: {len(then)} tensors of shapes {then[:4]}..., now {len(now)} "
                f"of shapes {now[:4]}..."
            )
        targets, news = [share for _, share in shares], list(self.tensors)
        with torch.no_grad():
            if any(hasattr(p, "ds_tensor") for p, _ in shares):  # ZeRO-3: collective, every rank
                pairs = zip(shares, self.tensors)
                whole = [(p, old) for (p, _), old in pairs if _held_whole(p)]
                targets += [p.data for p, _ in whole]
                news += _gathered([p for p, _ in whole], [old for _, old in whole])
            live = [t.clone() for t in targets]
            for target, new in zip(targets, news):
                target.copy_(new)
        try:
            yield
        finally:
            with torch.no_grad():
                for target, mine in zip(targets, live):
                    target.copy_(mine)
