"""`moe_experts`' layout-invariant backward: per-sequence expert partials, row-invariant input grads.

The spans describe hidden's rows (tokens). A token's (token, slot) pairs are grouped
by expert as in the forward (`Grouping`: ascending expert, then slot, then token);
restricted to one sequence that order is the sequence's own (slot, then its token
order), whatever the other tokens.

- Partials, per sequence and per expert it routed a pair to, one chain each over the
  sequence's pairs of that expert in that order (the backend's ExactGemm, fp32):
  gate_up[e]: grad_gate_up_out^T x (2I, H); down[e]: grad_y^T activation (H, I). They go
  to `sink.add_rows(param, role, index, experts, values)` (roles "moe_gate_up",
  "moe_down"): experts the sorted unique expert ids, values (len(experts), *param.shape[1:]).
  Pairs of tokens in no span (padding) contribute nothing.
- Input gradients: every GEMM a row's through the ExactGemm (rounded once to the model
  dtype, as the plain backward's GEMMs), SiLU's derivative from exp, +, -, *, / (torch's
  fused silu backward rounds by position), the routing weight's gradient a chain over H
  of the fp32 products, and a token's rows added in ascending expert order (`combine`).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.sequence_grads import ExactGemm, transposed


def _token_sequences(spans, tokens: int) -> torch.Tensor:
    """(N,) int64: each token's position in spans (-1: padding)."""
    out = torch.full((tokens,), -1, dtype=torch.long)
    for i in range(len(spans)):
        out[spans.starts[i] : spans.starts[i] + spans.lengths[i]] = i
    return out


def _silu_grad(gate: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """grad * d silu(gate) / d gate in fp32, rounded once to gate's dtype (row-invariant)."""
    g32 = gate.to(at_least_fp32(gate.dtype))
    s = 1.0 / (1.0 + torch.exp(-g32))
    return (grad.to(g32.dtype) * s * (1.0 + g32 * (1.0 - s))).to(gate.dtype)


def _row_dots(gemm: ExactGemm, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(S,): for each row, +0 then + a[s, h] * b[s, h] (fp32 products) for h in order."""
    acc = at_least_fp32(a.dtype)
    products = a.to(acc) * b.to(acc)
    ones = torch.ones((1, products.shape[1]), dtype=acc, device=a.device)
    return gemm(products, ones)[:, 0]


def _rows_matmul(gemm, a: torch.Tensor, w: torch.Tensor, dtype) -> torch.Tensor:
    """a (n, N) @ w (N, K) -> (n, K) in dtype, one chain over N per output."""
    return gemm(a, transposed(w, a.dtype)).to(dtype)


def sequence_experts_backward(
    gemm, combine, grad_out, hidden, gate_up, down, weights, saved, silu, needs, spans, sink
):
    """(grad hidden, grad weights); partials go to the sink. `combine` is the forward's
    (moe_experts.combine: a token's rows added in ascending expert order)."""
    grouping, saved_gate_up, saved_down = saved
    dtype, width = hidden.dtype, gate_up.shape[1] // 2
    promoted = torch.promote_types(dtype, weights.dtype)
    pair_weights = weights.t().reshape(-1)[grouping.order].to(promoted)  # (S,)
    grad_scaled = grad_out.index_select(0, grouping.tokens).to(promoted)  # (S, H)
    grad_pairs = _row_dots(gemm, grad_scaled, saved_down.to(promoted)).to(weights.dtype)
    grad_y = (grad_scaled * pair_weights[:, None]).to(dtype)  # (S, H)
    del grad_scaled
    gate, up = saved_gate_up.chunk(2, dim=-1)  # (S, I) each
    act = silu(gate)  # the forward's activation, recomputed by the same op
    grad_act = torch.empty_like(act)  # (S, I)
    for expert, start, stop in grouping.spans:
        grad_act[start:stop] = _rows_matmul(gemm, grad_y[start:stop], down[expert], dtype)
    grad_gate_up_out = torch.empty_like(saved_gate_up)  # (S, 2I)
    grad_gate_up_out[:, :width] = _silu_grad(gate, grad_act * up)
    torch.mul(grad_act, act, out=grad_gate_up_out[:, width:])
    del grad_act
    owner = _token_sequences(spans, hidden.shape[0])[grouping.tokens.cpu()]  # (S,)
    if needs[2]:
        activation = act * up  # (S, I): the down projection's input
        _send(gemm, grouping, owner, grad_y, activation, down, "moe_down", spans, sink)
        del activation
    if needs[1]:
        x = hidden.index_select(0, grouping.tokens)  # (S, H)
        _send(gemm, grouping, owner, grad_gate_up_out, x, gate_up, "moe_gate_up", spans, sink)
        del x
    grad_hidden = None
    if needs[0]:
        grad_rows = torch.empty_like(saved_down)  # (S, H)
        for expert, start, stop in grouping.spans:
            grad_rows[start:stop] = _rows_matmul(
                gemm, grad_gate_up_out[start:stop], gate_up[expert], dtype
            )
        grad_hidden = combine(grad_rows, grouping.combine_rows)
    grad_weights = torch.empty_like(grad_pairs)
    grad_weights[grouping.order] = grad_pairs  # slot-major (k * N,)
    return grad_hidden, grad_weights.view(weights.shape[::-1]).t()


def _send(gemm, grouping, owner, grad_rows, inputs, param, role, spans, sink) -> None:
    """Per sequence: for each expert it routed a pair to, grad_rows^T inputs over its pairs."""
    per_sequence = [([], []) for _ in range(len(spans))]
    for expert, start, stop in grouping.spans:
        mine = owner[start:stop]
        for i in torch.unique(mine[mine >= 0]).tolist():
            rows = start + (mine == i).nonzero().squeeze(1).to(grad_rows.device)
            dy_t = transposed(grad_rows[rows], param.dtype)
            x_t = transposed(inputs[rows], param.dtype)
            per_sequence[i][0].append(expert)
            per_sequence[i][1].append(gemm(dy_t, x_t))  # (out, in) of param[expert]
    acc = at_least_fp32(param.dtype)
    for i, index in enumerate(spans.indices):
        experts, parts = per_sequence[i]
        values = (
            torch.stack(parts)
            if parts
            else torch.zeros((0, *param.shape[1:]), dtype=acc, device=param.device)
        )
        rows = torch.tensor(experts, dtype=torch.long, device=param.device)
        sink.add_rows(param, role, index, rows, values)
