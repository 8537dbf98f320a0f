"""Where a patched model's backward sends per-sequence gradient partials (layout-invariant training).

The worker binds one `GradientRoute` to a patched model (`bind_gradient_route`) and, before each
training forward, sets which rows are which sequence: `spans` over the decoder's flattened
token rows (every projection, norm, the embedding and the MoE ops see those rows) and
`logp_spans` over the rows `linear_logp` scores. The patched modules then call their ops with
`spans=` and `sink=` (kernels/common/sequence_spans.py), so each op's backward hands every
sequence's partial of each parameter to `sink` instead of a batched gradient. With no route
bound, or spans unset (a rollout engine, a no-grad forward), the ops run as always.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from rl_engine.kernels import SequenceSpans

ROUTE_ATTRIBUTE = "rl_engine_gradient_route"


@dataclass
class GradientRoute:
    """The sink of a layout-invariant step and the current forward's spans."""

    sink: object | None = None
    spans: SequenceSpans | None = None
    logp_spans: SequenceSpans | None = None

    def set(self, sink, spans: SequenceSpans, logp_spans: SequenceSpans) -> None:
        self.sink, self.spans, self.logp_spans = sink, spans, logp_spans

    def clear(self) -> None:
        self.sink = self.spans = self.logp_spans = None

    def decoder_kwargs(self, rows: int) -> dict:
        """The `spans=` / `sink=` of an op whose input has `rows` flattened rows ({} when unset):
        the decoder's token rows, or k rows per token (a per-head norm's (B, T, heads, D)
        input: a token's heads are consecutive rows, so its sequence's span is k times as long)."""
        if self.spans is None:
            return {}
        spans = self.spans
        if rows != spans.rows:
            if spans.rows == 0 or rows % spans.rows:
                raise ValueError(
                    f"an op's input has {rows} rows, not a multiple of the micro-batch's "
                    f"{spans.rows} token rows: the gradient route cannot say which are whose"
                )
            k = rows // spans.rows
            spans = replace(
                spans,
                rows=rows,
                starts=tuple(start * k for start in spans.starts),
                lengths=tuple(length * k for length in spans.lengths),
            )
        return {"spans": spans, "sink": self.sink}

    def logp_kwargs(self) -> dict:
        """The `spans=` / `sink=` of `linear_logp` ({} when unset)."""
        return {} if self.logp_spans is None else {"spans": self.logp_spans, "sink": self.sink}


def bind_gradient_route(model: nn.Module, route: GradientRoute) -> None:
    """Give every patched module of `model` (and `model` itself, for `linear_logp`) `route`."""
    from rl_engine.patching.modules import PatchedOp

    setattr(model, ROUTE_ATTRIBUTE, route)
    for module in model.modules():
        if isinstance(module, PatchedOp):
            module.gradient_route = route


def gradient_route(model: nn.Module) -> GradientRoute | None:
    """The route bound to `model`, or None."""
    return getattr(model, ROUTE_ATTRIBUTE, None)
