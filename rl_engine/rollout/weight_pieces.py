"""The pieces of a weight sync: which elements each sender sends each receiver, and where they land.

Index arithmetic. See a tensor of shape S as its flat row-major array and a
receiver's `DimSlice` of dimension d with ranges (a_i, b_i); let
inner = prod(S[d + 1:]), block = S[d] * inner and width = sum_i (b_i - a_i) * inner.
Flat position p is "needed" when its dim-d index (p % block) // inner lies in
a range. The receiver's shard (its own target tensor, row-major) holds the
needed positions in increasing order, so the number of needed positions
below x,

    needed_before(x) = (x // block) * width + sum_i clamp(x % block - a_i * inner, 0, (b_i - a_i) * inner),

is the shard's flat index of the first needed position >= x. A sender holds a
contiguous range [lo, hi) of the flat tensor; the needed positions in it are
consecutive among all needed positions, so they fill ONE contiguous range of
the shard, [needed_before(lo), needed_before(hi)). Hence a receiver receives
every piece straight into a view of its parameter (no staging buffer), and a
sender sends a view of its own storage when the needed positions are
contiguous there (the whole tensor, a slice of dimension 0, a run inside one
block) and packs them otherwise (a strided copy no larger than the bucket).

A receiver's pieces are cut to at most `bucket_bytes` and grouped, in
manifest order, into buckets of at most `bucket_bytes` in all. The list is a
function of (manifest, that receiver's plan, bucket_bytes) alone, so both
ends build it without knowing the other receivers' plans; a piece's index in
it is its message tag. Every process posts the sends or receives of bucket k
(a sender: for every receiver), waits for them, then goes on to bucket k + 1,
so a sender holds at most one bucket of packed data per receiver in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.rollout.weight_plan import DimSlice, TensorSpec, WeightManifest, WeightPlan


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, stop) of receiver `receiver`'s shard of tensor `tensor`, from sender `sender`."""

    index: int
    """Position in the sync's piece list: the message tag."""
    tensor: int
    sender: int
    receiver: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class _Geometry:
    """A DimSlice of one tensor in flat terms (a whole tensor is the slice of all of dim 0)."""

    block: int
    inner: int
    width: int
    ranges: tuple[tuple[int, int], ...]  # (a_i * inner, b_i * inner): runs inside a block
    offsets: tuple[int, ...]  # shard offset of each run inside a block

    @classmethod
    def of(cls, shape: tuple[int, ...], piece: DimSlice | None) -> _Geometry:
        numel = 1
        for d in shape:
            numel *= d
        if piece is None:
            return cls(max(numel, 1), 1, max(numel, 1), ((0, numel),), (0,))
        inner = 1
        for d in shape[piece.dim + 1 :]:
            inner *= d
        runs = tuple((a * inner, b * inner) for a, b in piece.ranges)
        offsets, total = [], 0
        for a, b in runs:
            offsets.append(total)
            total += b - a
        return cls(shape[piece.dim] * inner, inner, total, runs, tuple(offsets))

    def needed_before(self, x: int) -> int:
        full, rem = divmod(x, self.block)
        return full * self.width + sum(min(max(rem - a, 0), b - a) for a, b in self.ranges)

    def position(self, k: int) -> tuple[int, int]:
        """(flat position of shard element k, length of the run it starts in the source)."""
        blk, w = divmod(k, self.width)
        for (a, b), off in zip(self.ranges, self.offsets):
            if w < off + (b - a):
                return blk * self.block + a + (w - off), off + (b - a) - w
        raise AssertionError("shard index outside the block")  # pragma: no cover


def plan_pieces(
    manifest: WeightManifest, plan: WeightPlan, receiver: int, bucket_bytes: int
) -> list[list[Piece]]:
    """One receiver's pieces in buckets of at most `bucket_bytes` (manifest order, then
    sender): a function of that receiver's plan alone, so the senders and the receiver
    build the same list without knowing the other receivers' plans."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[Piece]] = [[]]
    used, index = 0, 0
    for t, spec in enumerate(manifest.tensors):
        if spec.name not in plan.slices:
            continue
        itemsize = spec.torch_dtype.itemsize
        step = max(1, bucket_bytes // itemsize)
        geometry = _Geometry.of(spec.shape, plan.slices[spec.name])
        for s, (lo, hi) in enumerate(spec.sources):
            first, last = geometry.needed_before(lo), geometry.needed_before(hi)
            for start in range(first, last, step):
                piece = Piece(index, t, s, receiver, start, min(last, start + step))
                index += 1
                size = piece.numel * itemsize
                if used and used + size > bucket_bytes:
                    buckets.append([])
                    used = 0
                buckets[-1].append(piece)
                used += size
    return [b for b in buckets if b]


def source_elements(
    held: torch.Tensor, spec: TensorSpec, sender: int, piece_slice: DimSlice | None, piece: Piece
) -> torch.Tensor:
    """The elements a sender sends for `piece`, from `held` (the 1-D range of the flat tensor
    this sender holds): a view when they are contiguous there, else a packed copy."""
    lo = spec.sources[sender][0]
    geometry = _Geometry.of(spec.shape, piece_slice)
    k, parts = piece.start, []
    while k < piece.stop:
        position, run = geometry.position(k)
        blk, w = divmod(k, geometry.width)
        whole_blocks = (piece.stop - k) // geometry.width if w == 0 else 0
        if whole_blocks > 1 and run < geometry.width:  # strided: one view per range
            parts.append(_strided_blocks(held, lo, geometry, blk, whole_blocks))
            k += whole_blocks * geometry.width
            continue
        n = min(run, piece.stop - k)
        parts.append(held[position - lo : position - lo + n])
        k += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _strided_blocks(held, lo: int, geometry: _Geometry, blk: int, count: int) -> torch.Tensor:
    """(count, width) of the needed elements of `count` whole blocks from block `blk` on; every
    element read is a needed one, so the views stay inside this sender's range."""
    columns = []
    for a, b in geometry.ranges:
        first = blk * geometry.block + a - lo
        columns.append(
            held.as_strided((count, b - a), (geometry.block, 1), held.storage_offset() + first)
        )
    return torch.cat(columns, dim=1).reshape(-1)


def target_view(target: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The contiguous range of a receiver's own tensor that `piece` fills."""
    return target.view(-1)[piece.start : piece.stop]
