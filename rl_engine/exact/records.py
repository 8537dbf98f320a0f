"""Named sums that add up over micro-batches and ranks and cross a collective as one tensor.

A step's metrics start as sums: each micro-batch adds its part (`merge`), each rank's
total is all-reduced (`all_reduce`), and the metrics are read off the result. `Sums` is the
base of such a record: a frozen dataclass of float fields, each added up, or maxed where it
is declared with `maximum()` (whose default, the start of that max, is the field's own).

On the wire the record is `pack()`: one (n,) fp64 CPU tensor of the fields in declaration
order. `all_reduce` sums that whole tensor in one collective and, when the record has max
fields, maxes those entries in a second one, then `unpack`s. The field order is therefore
the layout every rank must share: append new fields, never reorder.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Self

import torch

from rl_engine.exact.float_sums import exact_sum

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""`all_reduce(tensor, op)` -> the tensor reduced over ranks, op 'sum' or 'max'."""

_REDUCE = "reduce"


def maximum(default: float = 0.0):
    """A field combined by max instead of addition; `default` starts the max (e.g. -inf)."""
    return field(default=default, metadata={_REDUCE: "max"})


@dataclass(frozen=True, slots=True)
class Sums:
    """Base of a record of float sums (see the module docstring); subclasses declare the fields."""

    @classmethod
    def _maxed(cls) -> list[int]:
        """Positions of the max fields in the packed tensor."""
        return [i for i, f in enumerate(fields(cls)) if f.metadata.get(_REDUCE) == "max"]

    def merge(self, other: Self) -> Self:
        """The record of both parts: each field added, or maxed where declared."""
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        values = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            values.append(_max(a, b) if f.metadata.get(_REDUCE) == "max" else a + b)
        return type(self)(*values)

    def pack(self) -> torch.Tensor:
        """(n,) fp64 CPU: the fields in declaration order."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensors(cls, **values: torch.Tensor) -> Self:
        """The record of 0-d tensors by field name (any device and dtype; fp64 holds every fp32
        value and count exactly), copied to the host at once: one device sync, not one each."""
        host = torch.stack([v.detach().to(torch.float64) for v in values.values()]).cpu()
        return cls(**dict(zip(values, host.tolist())))

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> Self:
        """The record `pack` gave `packed`."""
        values, names = packed.tolist(), [f.name for f in fields(cls)]
        if len(values) != len(names):
            raise ValueError(
                f"{cls.__name__} packs {len(names)} values ({', '.join(names)}), got {len(values)}"
            )
        return cls(*values)

    def all_reduce(self, all_reduce: AllReduce) -> Self:
        """The record over every rank (collective): one 'sum' all-reduce of the packed tensor,
        and one 'max' all-reduce of its max fields when it has any."""
        packed = self.pack()
        out = all_reduce(packed, "sum")
        maxed = self._maxed()
        if maxed:
            out[maxed] = all_reduce(packed[maxed], "max")  # a copy: the sum may reuse `packed`
        return self.unpack(out)

    def finite(self) -> bool:
        """Whether every field is finite."""
        return all(math.isfinite(getattr(self, f.name)) for f in fields(self))


def _max(a: float, b: float) -> float:
    """max that propagates NaN, as torch.maximum does (a NaN part must show in the total)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


@dataclass(frozen=True, slots=True)
class SequenceRecords:
    """Per-sequence records of one `Sums` type, totalled exactly: the layout-invariant mode's
    metrics (trainer.layout_invariant).

    A sequence's record depends on that sequence alone; the step's total is each sum field's
    `math.fsum` over every rank's records (the correctly rounded sum, whatever the order or the
    grouping) and each max field's max. So the total is the same for every split of the
    sequences into micro-batches and ranks, unlike the plain path's float adds in layout order.
    """

    kind: type
    records: tuple = ()

    def merge(self, other: SequenceRecords) -> SequenceRecords:
        if not isinstance(other, SequenceRecords) or other.kind is not self.kind:
            what = (
                f"{other.kind.__name__} records"
                if isinstance(other, SequenceRecords)
                else type(other).__name__
            )
            raise TypeError(f"cannot merge {what} into {self.kind.__name__} records")
        return SequenceRecords(self.kind, self.records + other.records)

    def finite(self) -> bool:
        return all(record.finite() for record in self.records)

    def total(self, all_gather: Callable[[object], list] | None = None) -> Sums:
        """The exact total over this rank's records, or over every rank's with `all_gather`
        (a collective: `Collectives.all_gather`)."""
        records = list(self.records)
        if all_gather is not None:
            records = [r for rank_records in all_gather(self.records) for r in rank_records]
        values = []
        for f in fields(self.kind):
            column = [getattr(r, f.name) for r in records]
            if f.metadata.get(_REDUCE) == "max":
                total = f.default
                for value in column:
                    total = _max(total, value)
                values.append(total)
            else:
                values.append(exact_sum(column))
        return self.kind(*values)
