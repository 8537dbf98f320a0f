"""The MoE auxiliary loss under trainer.layout_invariant: the sequence-wise balance loss.

HF's load-balancing loss (rl_engine/algorithms/router.py) takes f and P as means over a
micro-batch's tokens, so the gradient a token gets depends on which sequences share its
micro-batch. Under the mode each sequence s (n_s real tokens: every token the router saw,
prompt and completion) gets HF's formula over its own tokens, as DeepSeek-V3's complementary
sequence-wise balance loss does:

    aux_s = E * sum_e f_e P_e,  f_e = c_e / (n_s L),  P_e = (sum over s's tokens t and layers l
    of p_tl[e]) / (n_s L)

(c_e: s's token-slots routed to expert e over the L sparse layers; p_tl: the router's fp32
softmax of token t's logits in layer l), and a mini-batch's aux is sum_s (n_s / N) aux_s
(N: its real tokens on all ranks). That is a sum of per-token terms p_tl . u_s with

    u_s[e] = E c_e / (N n_s L^2)

which integer counts alone define (each rounded once from the exact rational). The loss
backpropagated is the sum of p_tl . (coef u_s) over the rows, so its backward gives each
token's probabilities coef u_s exactly; the softmax's backward is `_BalanceTerm`'s, row by row
with the row's dot in a fixed order (torch 2.13's own softmax backward on this CPU changed bits
with the thread count at 60 experts, not at 64).

The metric `router/aux_loss`: each sequence's sum of p_tl . u_s (each row's dot in fp64, in a
fixed order; the rows' values summed by `exact_sum`) is its `AuxSums` record, and the step totals the
records exactly (rl_engine.exact.records.SequenceRecords), so no layout enters it either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from rl_engine.exact.float_sums import exact_sum
from rl_engine.exact.records import SequenceRecords, Sums
from rl_engine.kernels import SequenceSpans
from rl_engine.kernels.common.moe_router import fixed_order_sum, router_probabilities


@dataclass(frozen=True, slots=True)
class AuxSums(Sums):
    """One sequence's share of its mini-batch's auxiliary loss: (n_s / N) aux_s."""

    aux_loss: float = 0.0


class RouterRowsError(ValueError):
    """The recorded routing does not have the rows the micro-batch's sequences span."""


def balance_weights(counts: Sequence[int], tokens: int, total: int, layers: int, scale=1.0):
    """(E,) fp64: scale x E x counts[e] / (total x tokens x layers^2), rounded once from the
    exact rational (`scale` a float, taken exactly)."""
    experts = len(counts)
    below = total * tokens * layers * layers
    exact = [Fraction(scale) * Fraction(experts * int(c), below) for c in counts]
    return torch.tensor([float(value) for value in exact], dtype=torch.float64)


class _BalanceTerm(torch.autograd.Function):
    """sum(probs * weights), probs = softmax(logits) given; the backward to the logits, row by
    row: probs * (g - probs . g), g = weights x the incoming gradient, the dot in slot order."""

    @staticmethod
    def forward(ctx, logits, probs, weights):
        ctx.save_for_backward(probs, weights)
        ctx.logits_dtype = logits.dtype
        return (probs * weights).sum()

    @staticmethod
    def backward(ctx, grad):
        probs, weights = ctx.saved_tensors
        g = weights * grad.to(weights.dtype)
        grad_logits = probs * (g - fixed_order_sum(probs * g))
        return grad_logits.to(ctx.logits_dtype), None, None


def sequence_balance(
    logits: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    spans: SequenceSpans,
    num_experts: int,
    total: int,
    coef: float,
) -> tuple[torch.Tensor | None, SequenceRecords]:
    """(loss term to add to the micro-batch's loss, None when coef is 0; one AuxSums per
    sequence of `spans`) from each sparse layer's logits (rows, E) and chosen experts (rows, k)
    of one micro-batch; `total`: N, its mini-batch's real tokens on all ranks."""
    rows = logits[0].shape[0]
    if spans.rows != rows or any(t.shape[0] != rows for t in (*logits, *indices)):
        raise RouterRowsError(
            f"the micro-batch's sequences span {spans.rows} rows but the router recorded "
            f"{[t.shape[0] for t in logits]} logits rows and {[t.shape[0] for t in indices]} "
            "expert rows per layer"
        )
    unit, scaled = _row_weights(indices, spans, num_experts, total, coef)
    probs = [router_probabilities(layer.detach()) for layer in logits]
    records = sequence_aux_records(probs, unit.to(probs[0].device), spans)
    if coef == 0:
        return None, records
    weights = scaled.to(device=probs[0].device, dtype=probs[0].dtype)
    terms = [_BalanceTerm.apply(x, p, weights) for x, p in zip(logits, probs)]
    return torch.stack(terms).sum(), records


def _row_weights(indices, spans: SequenceSpans, num_experts: int, total: int, coef: float):
    """(rows, E) fp64 u_s and coef u_s on every row of sequence s; 0 on padding rows."""
    layers, rows = len(indices), spans.rows
    unit = torch.zeros(rows, num_experts, dtype=torch.float64)
    scaled = torch.zeros(rows, num_experts, dtype=torch.float64)
    host = [layer.detach().cpu() for layer in indices]
    for lo, n in zip(spans.starts, spans.lengths):
        if n == 0:
            continue
        counts = sum(
            torch.bincount(ix[lo : lo + n].reshape(-1), minlength=num_experts) for ix in host
        )
        counts = counts.tolist()
        unit[lo : lo + n] = balance_weights(counts, n, total, layers)
        scaled[lo : lo + n] = balance_weights(counts, n, total, layers, coef)
    return unit, scaled


def sequence_aux_records(probs, unit: torch.Tensor, spans: SequenceSpans) -> SequenceRecords:
    """Each sequence's sum over its rows and the layers of p . u_s (fp64 row dots, summed by
    `exact_sum`: a non-finite dot gives a non-finite record, never an exception)."""
    dots = torch.cat([fixed_order_sum(p.double() * unit) for p in probs], dim=1).cpu()  # (rows, L)
    records = tuple(
        AuxSums(exact_sum(dots[lo : lo + n].reshape(-1).tolist()))
        for lo, n in zip(spans.starts, spans.lengths)
    )
    return SequenceRecords(AuxSums, records)
