"""Which rows of an op's input belong to which sequence: the layout-invariant backward's input.

In layout-invariant training a parameter's gradient is a fixed tree over per-sequence
partials (the tree is not the kernels' business). An op run with `spans` and a `sink`
therefore sends, for every sequence of its call, that sequence's partial of each
trainable parameter to the sink, summed over the sequence's own rows only, in an order
the sequence alone defines (docs/operators.md, "Backward in layout-invariant mode").

`SequenceSpans` says which rows those are. Rows are the op's input flattened to 2-D
(`x.reshape(-1, K)`): for the decoder's projections, norms and embedding that is a padded
(B, T) batch or packed rows (R, N) flattened; for `linear_logp` it is the rows of its own
`hidden` (padded: (B, T-1), position t scoring token t+1; packed: the packed rows).
Rows in no span are padding: they contribute nothing to any parameter, not even +0.

The sink is the caller's object (`GradientSink`); the kernels only call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class GradientSink(Protocol):
    """Receives per-sequence parameter partials from an op's backward.

    `index` is the sequence's canonical index (`SequenceSpans.indices`); `role` names the
    op's use of the parameter ("linear", "bias", "lm_head", "embedding", "rms_norm").
    Every sequence of a call is reported once per trainable parameter, an empty one too
    (zeros, or no rows), so the set of (parameter, role, index) does not depend on the layout.
    """

    def add(self, param: torch.Tensor, role: str, index: int, partial: torch.Tensor) -> None:
        """partial: param's shape, fp32 (fp64 for an fp64 parameter); a dense tensor, or a
        `ProductPartial` (kernels/common/product_partial.py) standing for one: the LM head's,
        whose dense form is large (`product_partial.dense` gives it)."""

    def add_rows(
        self,
        param: torch.Tensor,
        role: str,
        index: int,
        rows: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """rows: sorted unique int64 row ids of `param`; values (len(rows), H) fp32 (fp64)."""


@dataclass(frozen=True, slots=True)
class SequenceSpans:
    """The sequences of a call's flattened rows, in canonical order.

    Sequence i holds rows starts[i] .. starts[i] + lengths[i] - 1 (a length may be 0);
    indices[i] is its canonical index in the step (strictly increasing). Spans never
    overlap; rows in none are padding.
    """

    rows: int
    """Number of flattened rows the spans describe (the op checks its input has them)."""
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or self.rows < 0:
            raise ValueError(f"SequenceSpans.rows must be an int >= 0, got {self.rows!r}")
        count = len(self.starts)
        if len(self.lengths) != count or len(self.indices) != count:
            raise ValueError(
                f"SequenceSpans needs one start, length and index per sequence, got "
                f"{count} starts, {len(self.lengths)} lengths, {len(self.indices)} indices"
            )
        for i, (start, length) in enumerate(zip(self.starts, self.lengths)):
            if start < 0 or length < 0 or start + length > self.rows:
                raise ValueError(
                    f"SequenceSpans: sequence {i} (start {start}, length {length}) does not lie "
                    f"in rows [0, {self.rows})"
                )
        for i in range(1, count):
            if self.indices[i] <= self.indices[i - 1]:
                raise ValueError(
                    f"SequenceSpans.indices must increase: index {self.indices[i]} at position "
                    f"{i} follows {self.indices[i - 1]}"
                )
        by_start = sorted(range(count), key=lambda i: self.starts[i])
        for a, b in zip(by_start, by_start[1:]):
            if self.starts[a] + self.lengths[a] > self.starts[b]:
                raise ValueError(
                    f"SequenceSpans: sequences {a} (rows {self.starts[a]}.."
                    f"{self.starts[a] + self.lengths[a] - 1}) and {b} (from row "
                    f"{self.starts[b]}) overlap"
                )

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def max_length(self) -> int:
        return max(self.lengths, default=0)

    def row_ids(self, i: int) -> range:
        """The rows of sequence i, in order."""
        return range(self.starts[i], self.starts[i] + self.lengths[i])

    def covered(self, device=None) -> torch.Tensor:
        """(rows,) bool: True on the rows of some sequence."""
        mask = torch.zeros(self.rows, dtype=torch.bool, device=device)
        for start, length in zip(self.starts, self.lengths):
            mask[start : start + length] = True
        return mask

    @classmethod
    def from_padding_mask(
        cls, mask: torch.Tensor, indices: list[int] | tuple[int, ...] | None = None
    ) -> SequenceSpans:
        """A padded (B, T) batch flattened to B*T rows: batch row b is sequence b, its tokens
        (mask != 0) one contiguous run (left or right padding). indices: the canonical index
        of each batch row (distinct, any order: the spans are listed by index; default
        0..B-1)."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"mask must be a 2-D (B, T) tensor, got {_shape_of(mask)}")
        live = mask.detach().to("cpu") != 0
        B, T = live.shape
        starts, lengths = [], []
        for b in range(B):
            cols = live[b].nonzero().squeeze(1).tolist()
            if cols and cols[-1] - cols[0] + 1 != len(cols):
                raise ValueError(
                    f"mask row {b}: its tokens must be one contiguous run (left or right "
                    f"padding), got columns {_runs(cols)}"
                )
            starts.append(b * T + (cols[0] if cols else 0))
            lengths.append(len(cols))
        return _canonical(cls, B * T, starts, lengths, _indices(indices, B, "batch rows"))

    @classmethod
    def from_segments(
        cls, segments: torch.Tensor, indices: list[int] | tuple[int, ...] | None = None
    ) -> SequenceSpans:
        """Packed rows (R, N) flattened to R*N rows: segment id s (0 .. S-1) marks sequence s's
        tokens, one contiguous run; -1 marks padding (`rl_engine.logprobs.packing.PackedBatch`).
        indices: the canonical index of each segment id (distinct, any order; default
        0..S-1)."""
        if not isinstance(segments, torch.Tensor) or segments.dim() != 2:
            raise ValueError(f"segments must be a 2-D (R, N) tensor, got {_shape_of(segments)}")
        if segments.dtype.is_floating_point or segments.dtype == torch.bool:
            raise ValueError(f"segments must be integer ids, got dtype {segments.dtype}")
        flat = segments.detach().to("cpu").reshape(-1).long()
        if flat.numel() and int(flat.min()) < -1:
            raise ValueError(f"segments: ids are >= 0, or -1 for padding; got {int(flat.min())}")
        count = int(flat.max()) + 1 if flat.numel() else 0
        if indices is not None:
            count = max(count, len(indices))
        starts, lengths = [], []
        for s in range(count):
            rows = (flat == s).nonzero().squeeze(1).tolist()
            if rows and rows[-1] - rows[0] + 1 != len(rows):
                raise ValueError(
                    f"segments: sequence {s} must be one contiguous run of rows, got flat rows "
                    f"{_runs(rows)}"
                )
            starts.append(rows[0] if rows else 0)
            lengths.append(len(rows))
        return _canonical(cls, flat.numel(), starts, lengths, _indices(indices, count, "segments"))


def check_sequence_mode(op: str, spans, sink, rows: int) -> bool:
    """True when the op runs in layout-invariant mode (spans and sink given); raises on half of it
    or on spans of another row count."""
    if spans is None and sink is None:
        return False
    if spans is None or sink is None:
        given, missing = ("spans", "sink") if sink is None else ("sink", "spans")
        raise ValueError(
            f"{op}: {given} is given but {missing} is None: the layout-invariant backward "
            "needs both (which rows are which sequence, and where their partials go)"
        )
    if not isinstance(spans, SequenceSpans):
        raise TypeError(f"{op}: spans must be a SequenceSpans, got {type(spans).__name__}")
    if spans.rows != rows:
        raise ValueError(
            f"{op}: spans describe {spans.rows} rows but the input has {rows} rows "
            "(its leading dims flattened)"
        )
    return True


def _canonical(cls, rows: int, starts, lengths, indices) -> SequenceSpans:
    """The spans sorted by canonical index (a repeated index fails the dataclass's check)."""
    order = sorted(range(len(indices)), key=lambda i: indices[i])
    return cls(
        rows,
        tuple(starts[i] for i in order),
        tuple(lengths[i] for i in order),
        tuple(indices[i] for i in order),
    )


def _indices(indices, count: int, what: str) -> tuple[int, ...]:
    if indices is None:
        return tuple(range(count))
    out = tuple(int(i) for i in indices)
    if len(out) != count:
        raise ValueError(f"indices: got {len(out)}, but there are {count} {what}")
    return out


def _runs(ids: list[int]) -> str:
    """'3..5, 9..9' for [3, 4, 5, 9]."""
    runs, first = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append(f"{first}..{a}")
            first = b
    return ", ".join(runs)


def _shape_of(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def placeholder_grad(sink, param: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
    """What the backward returns to autograd for a parameter whose partials went to the sink:
    None, or zeros when the sink asks for them (`sink.placeholder_grads`: a caller whose
    optimizer only steps parameters that received a gradient, as DeepSpeed's ZeRO-1/2 do)."""
    if param is None or not needed or not getattr(sink, "placeholder_grads", False):
        return None
    return torch.zeros_like(param)
