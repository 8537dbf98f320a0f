"""The only collectives a tensor-parallel engine runs: gathers and broadcasts, which copy bits.

A sum across ranks (all_reduce, reduce_scatter) is never used here: its order
changes with the number of ranks, and so would the bits (docs/scaling.md). The
house test `tests/rollout/tp/test_collectives.py` checks every module of this package for it.

Uneven shards (a vocabulary of 1003 over 2 ranks): each piece is padded to the
widest one before the gather and the padding is dropped after it, so padding
values are never read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardGroup:
    """A process group of tensor-parallel ranks, with this rank's index and the group size."""

    def __init__(self, group=None):
        """group: a torch.distributed process group (None: the default one, which must exist)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine needs torch.distributed initialised (one process per "
                "rank; see rl_engine.rollout.tp.launch)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # bytes this rank has sent (an all-gather sends its piece to the N - 1 others):
        # inside the decoder layers, and the LM head's logits to rank 0 (benchmarks read them)
        self.sent_layer_bytes = 0
        self.sent_logit_bytes = 0

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def gather_last(self, piece: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        """Every rank's piece (..., widths[r]) concatenated along the last dim, on every rank."""
        if self.world == 1:
            return piece
        padded = _pad_last(piece, max(widths))
        self.sent_layer_bytes += padded.numel() * padded.element_size() * (self.world - 1)
        pieces = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat([p[..., :w] for p, w in zip(pieces, widths)], dim=-1)

    def gather_last_to_first(self, piece: torch.Tensor, widths: tuple[int, ...]):
        """As `gather_last`, but only rank 0 receives the whole (others get None)."""
        if self.world == 1:
            return piece
        padded = _pad_last(piece, max(widths))
        if self.rank != 0:
            self.sent_logit_bytes += padded.numel() * padded.element_size()
        pieces = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(padded, pieces, dst=self.global_rank(0), group=self.group)
        if self.rank != 0:
            return None
        return torch.cat([p[..., :w] for p, w in zip(pieces, widths)], dim=-1)

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank (in place; same shape and dtype everywhere)."""
        if self.world > 1:
            dist.broadcast(tensor, src=self.global_rank(0), group=self.group)
        return tensor

    def gather_objects(self, value) -> list:
        """Every rank's picklable `value`, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out


def _pad_last(piece: torch.Tensor, width: int) -> torch.Tensor:
    if piece.shape[-1] == width:
        return piece.contiguous()
    out = piece.new_zeros(*piece.shape[:-1], width)
    out[..., : piece.shape[-1]] = piece
    return out
