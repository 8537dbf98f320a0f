"""Where a patched model's backward sends per-sequence partials (patching/gradient_route.py).

What it checks: with no spans set a route adds nothing to an op's call; with spans it hands
each op `spans=` and `sink=`, for the decoder's token rows as they are and for k rows per
token (a per-head norm) with every start and length scaled by k, and names an input whose rows
are not a multiple of the micro-batch's; `linear_logp` gets its own spans; `clear` unsets all;
`bind_gradient_route` reaches the model and every patched module, whose `route` then gives the
kwargs for its input rows.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels import SequenceSpans
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.gradient_route import GradientRoute, bind_gradient_route, gradient_route
from rl_engine.patching.modules import PatchedOp

SPANS = SequenceSpans(rows=5, starts=(0, 3), lengths=(3, 2), indices=(0, 1))
LOGP = SequenceSpans(rows=3, starts=(0, 2), lengths=(2, 1), indices=(0, 1))


def test_an_unset_route_adds_nothing_and_clear_unsets_it():
    route, sink = GradientRoute(), object()
    assert route.decoder_kwargs(5) == {} and route.logp_kwargs() == {}
    route.set(sink, SPANS, LOGP)
    assert route.decoder_kwargs(5) == {"spans": SPANS, "sink": sink}
    assert route.logp_kwargs() == {"spans": LOGP, "sink": sink}
    route.clear()
    assert (route.sink, route.spans, route.logp_spans) == (None, None, None)


def test_k_rows_per_token_scale_every_span_and_other_counts_are_named():
    route, sink = GradientRoute(), object()
    route.set(sink, SPANS, LOGP)
    heads = route.decoder_kwargs(10)["spans"]
    assert (heads.rows, heads.starts, heads.lengths, heads.indices) == (10, (0, 6), (6, 4), (0, 1))
    with pytest.raises(
        ValueError, match="an op's input has 7 rows, not a multiple of the micro-batch's 5"
    ):
        route.decoder_kwargs(7)


def test_binding_reaches_every_patched_module_and_its_op_call():
    model, _ = load_model("tiny-llama", seed=0)
    apply_batch_invariant(model)
    route = GradientRoute()
    bind_gradient_route(model, route)
    assert gradient_route(model) is route
    patched = [m for m in model.modules() if isinstance(m, PatchedOp)]
    assert patched and all(m.gradient_route is route for m in patched)
    q_proj = model.model.layers[0].self_attn.q_proj
    route.set(object(), SPANS, LOGP)
    assert q_proj.route(torch.zeros(1, 5, 4)) == route.decoder_kwargs(5)
    route.clear()
    assert q_proj.route(torch.zeros(1, 5, 4)) == {}
    assert gradient_route(load_model("tiny-llama", seed=0)[0]) is None
