"""What a weight sync moves: the senders' manifest and each receiver's plan.

A sync streams the policy from the trainer ranks (the senders) to the rollout
engines (the receivers) over a process group, straight into the engines'
parameter tensors. Two small records, exchanged once when the group is
connected, fix every byte of it:

- `WeightManifest` (the senders'): every tensor of the policy once, under its
  Hugging Face name with its tied aliases, its full shape and dtype, and the
  flat element range `[start, stop)` of it that each sender holds. Under
  ZeRO-3 that is the rank's own partition (nothing is gathered to send);
  ranks that hold the whole tensor split it evenly, so they send in parallel.
- `WeightPlan` (one per receiver): which tensors it wants, and of each either
  the whole tensor or a `DimSlice` (ranges of one dimension, in increasing
  order). A rollout engine of one process wants everything; a tensor-parallel
  rank wants its shards, e.g. rows `[r * N / n, (r + 1) * N / n)` of a
  column-parallel weight (`WeightPlan.split`).

`rl_engine.rollout.weight_pieces` turns the pair into the pieces each sender
sends and each receiver receives; `rl_engine.rollout.weight_receiver` is the
receiving side. The manifest's `digest` (with the plan's) travels in every
sync's header, so a receiver checks that a sync is the one it validated
before it writes a byte.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
}


class Work(Protocol):
    def wait(self) -> object: ...


class PointToPoint(Protocol):
    """The transport a sync runs over: tagged, asynchronous point-to-point sends of tensors.

    Ranks `0 .. num_senders - 1` are the senders, the receivers follow. A
    `torch.distributed` backend built for the weight group has this interface.
    """

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work: ...


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the policy as the senders hold it."""

    name: str
    """Hugging Face state-dict name (the first of its tied names)."""
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the `torch.` prefix ('bfloat16')."""
    sources: tuple[tuple[int, int], ...]
    """Flat element range [start, stop) held by each sender, in sender order; together they
    cover [0, numel) in order (a range may be empty)."""
    aliases: tuple[str, ...] = ()
    """Other state-dict names of the same tensor (tied weights)."""

    def __post_init__(self) -> None:
        if not self.name or any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: bad shape {self.shape!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"tensor {self.name!r}: dtype {self.dtype!r} not one of {list(DTYPES)}"
            )
        edge = 0
        for start, stop in self.sources:
            if start != edge or stop < start:
                raise ValueError(
                    f"tensor {self.name!r}: sender ranges {list(self.sources)} must cover "
                    f"[0, {self.numel}) in order"
                )
            edge = stop
        if edge != self.numel:
            raise ValueError(
                f"tensor {self.name!r}: sender ranges {list(self.sources)} cover [0, {edge}), "
                f"not [0, {self.numel})"
            )

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True, slots=True)
class WeightManifest:
    """Every tensor the senders send, in the order they send them."""

    tensors: tuple[TensorSpec, ...]
    num_senders: int

    def __post_init__(self) -> None:
        if self.num_senders < 1:
            raise ValueError(f"num_senders must be >= 1, got {self.num_senders}")
        seen: set[str] = set()
        for spec in self.tensors:
            if len(spec.sources) != self.num_senders:
                raise ValueError(
                    f"tensor {spec.name!r} has {len(spec.sources)} sender ranges for "
                    f"{self.num_senders} senders"
                )
            for name in spec.names:
                if name in seen:
                    raise ValueError(f"manifest names {name!r} twice")
                seen.add(name)

    @classmethod
    def even_split(
        cls,
        tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype, tuple[str, ...]]],
        senders: int,
    ) -> WeightManifest:
        """Manifest of tensors every sender holds whole: sender i sends the i-th of `senders`
        near-equal flat ranges of each (so they send in parallel)."""
        specs = [
            TensorSpec(
                name,
                tuple(shape),
                dtype_name(dtype),
                even_sources(_prod(shape), senders),
                tuple(aliases),
            )
            for name, shape, dtype, aliases in tensors
        ]
        return cls(tuple(specs), senders)

    def by_name(self) -> dict[str, TensorSpec]:
        """Every name (aliases too) -> its spec."""
        return {name: spec for spec in self.tensors for name in spec.names}

    @property
    def nbytes(self) -> int:
        return sum(s.numel * s.torch_dtype.itemsize for s in self.tensors)

    def nbytes_of(self, names: Iterable[str]) -> int:
        """Bytes of the distinct tensors named (primary names), each counted once."""
        wanted = set(names)
        return sum(s.numel * s.torch_dtype.itemsize for s in self.tensors if s.name in wanted)

    def to_json(self) -> str:
        return json.dumps(
            {
                "num_senders": self.num_senders,
                "tensors": [
                    [s.name, list(s.shape), s.dtype, [list(r) for r in s.sources], list(s.aliases)]
                    for s in self.tensors
                ],
            },
            separators=(",", ":"),
        )


@dataclass(frozen=True, slots=True)
class DimSlice:
    """Ranges of one dimension of a tensor, concatenated in increasing order (a shard)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """ValueError naming the tensor when the slice does not fit `shape`."""
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"plan for {name!r}: dim {self.dim} out of range for shape {shape}")
        edge = 0
        for start, stop in self.ranges:
            if start < edge or stop <= start or stop > shape[self.dim]:
                raise ValueError(
                    f"plan for {name!r}: ranges {list(self.ranges)} of dim {self.dim} must be "
                    f"increasing, non-empty and within [0, {shape[self.dim]})"
                )
            edge = stop
        if not self.ranges:
            raise ValueError(f"plan for {name!r}: a DimSlice needs at least one range")

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the shard of a tensor of `shape`."""
        out = list(shape)
        out[self.dim] = sum(stop - start for start, stop in self.ranges)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """What one receiver takes: tensor name -> its DimSlice, or None for the whole tensor.

    Names are the manifest's primary names; tensors not named are not sent to it.
    """

    slices: Mapping[str, DimSlice | None] = field(default_factory=dict)

    @classmethod
    def everything(cls, manifest: WeightManifest) -> WeightPlan:
        """The plan of a receiver that holds the whole model (tensor parallel size 1)."""
        return cls({spec.name: None for spec in manifest.tensors})

    @classmethod
    def split(
        cls, manifest: WeightManifest, dims: Mapping[str, int], rank: int, world: int
    ) -> WeightPlan:
        """Rank `rank` of `world` takes the `rank`-th of `world` even ranges of dimension
        dims[name] of each named tensor (which must divide evenly) and every other tensor whole."""
        by_name = manifest.by_name()
        slices: dict[str, DimSlice | None] = {spec.name: None for spec in manifest.tensors}
        for name, dim in dims.items():
            if name not in by_name:
                raise ValueError(f"plan names {name!r}, which the manifest does not have")
            spec = by_name[name]
            size = spec.shape[dim] if 0 <= dim < len(spec.shape) else -1
            if size < 0 or size % world:
                raise ValueError(
                    f"plan for {name!r}: dim {dim} of shape {spec.shape} does not split into {world}"
                )
            part = size // world
            slices[spec.name] = DimSlice(dim, ((rank * part, (rank + 1) * part),))
        return cls(slices)

    def only(self, names: Iterable[str]) -> WeightPlan:
        """This plan restricted to the tensors `names` (a partial sync, e.g. only a LoRA
        policy's adapters); ValueError naming a tensor the plan does not take."""
        wanted = set(names)
        unknown = sorted(wanted - set(self.slices))
        if unknown:
            raise ValueError(f"a partial plan names {unknown[0]!r}, which the plan does not take")
        return WeightPlan({n: piece for n, piece in self.slices.items() if n in wanted})

    def check(self, manifest: WeightManifest) -> None:
        """ValueError naming the first tensor the plan asks for wrongly."""
        by_name = {spec.name: spec for spec in manifest.tensors}
        for name, piece in self.slices.items():
            if name not in by_name:
                raise ValueError(
                    f"plan names {name!r}, which is not a tensor of the senders' manifest"
                )
            if piece is not None:
                piece.check(name, by_name[name].shape)

    def target_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        piece = self.slices[spec.name]
        return spec.shape if piece is None else piece.shape_of(spec.shape)

    def to_json(self) -> str:
        return json.dumps(
            {
                name: None if s is None else [s.dim, [list(r) for r in s.ranges]]
                for name, s in self.slices.items()
            },
            separators=(",", ":"),
            sort_keys=True,
        )


def sync_digest(manifest: WeightManifest, plan: WeightPlan, bucket_bytes: int) -> int:
    """A 31-bit fingerprint of (manifest, plan, bucket size), which fix a receiver's pieces:
    both sides of a sync must agree on it."""
    text = f"{manifest.to_json()}|{plan.to_json()}|{bucket_bytes}"
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def even_sources(numel: int, senders: int) -> tuple[tuple[int, int], ...]:
    """`senders` near-equal flat ranges covering [0, numel) in order."""
    bounds = [numel * i // senders for i in range(senders + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
