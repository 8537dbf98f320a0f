"""A partial that touches some rows of a tensor only, and its add: the dense add, bit for bit.

An embedding's per-sequence gradient touches only the rows of the sequence's token ids. As a
`RowPartial` (rows, values) it stands for the dense tensor with those rows and +0.0 in every
other row, and `add_rows` adds two of them exactly as their dense forms would add, element for
element: the union of the rows, each row left + right, where a child that lacks the row gives
+0.0 (so a row held by one child only still gets its `+ 0.0`: -0.0 becomes +0.0, inf and NaN
stay). Rows that neither child holds are +0.0 + +0.0 = +0.0 in the dense add, which is what the
sum's absent rows stand for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RowPartial:
    """A partial that touches some rows only: row `rows[i]` is `values[i]`, every other row of
    the dense tensor it stands for is +0.0."""

    rows: torch.Tensor
    """(r,) int64, sorted, unique, >= 0."""
    values: torch.Tensor
    """(r, *row_shape): the rows' values."""

    def __post_init__(self):
        rows, values = self.rows, self.values
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise ValueError(
                f"rows must be a 1-d int64 tensor, got {rows.dtype} {tuple(rows.shape)}"
            )
        if values.dim() < 1 or values.shape[0] != rows.numel():
            raise ValueError(
                f"values must have one row per index: {rows.numel()} rows, values {tuple(values.shape)}"
            )
        if rows.device != values.device:
            raise ValueError(f"rows on {rows.device}, values on {values.device}")
        if rows.numel() and (bool((rows[1:] <= rows[:-1]).any()) or int(rows[0]) < 0):
            raise ValueError("rows must be sorted, unique and >= 0")

    def densify(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The dense tensor of `shape` this partial stands for (+0.0 outside its rows)."""
        shape = tuple(shape)
        if shape[1:] != tuple(self.values.shape[1:]):
            raise ValueError(f"rows of shape {tuple(self.values.shape[1:])} do not fit {shape}")
        if self.rows.numel() and int(self.rows[-1]) >= shape[0]:
            raise ValueError(f"row {int(self.rows[-1])} is outside the {shape[0]} rows of {shape}")
        out = self.values.new_zeros(shape)
        return out.index_copy_(0, self.rows, self.values)


def add_rows(left: RowPartial, right: RowPartial) -> RowPartial:
    """The union rows, each left + right with +0.0 for a child that lacks it: the dense add."""
    if torch.equal(left.rows, right.rows):
        return RowPartial(left.rows, left.values.add_(right.values))
    rows = torch.unique(torch.cat([left.rows, right.rows]))  # sorted
    return RowPartial(rows, _spread(left, rows).add_(_spread(right, rows)))


def _spread(part: RowPartial, rows: torch.Tensor) -> torch.Tensor:
    """`part`'s values at the places of its rows among `rows` (a superset), +0.0 elsewhere."""
    out = part.values.new_zeros((rows.numel(), *part.values.shape[1:]))
    return out.index_copy_(0, torch.searchsorted(rows, part.rows), part.values)
