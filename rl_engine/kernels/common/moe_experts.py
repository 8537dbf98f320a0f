"""The `moe_experts` op, written once: everything but the backend's projections and activation.

Contract (docs/operators.md#moe_experts), for hidden (N, H), gate_up (E, 2I, H),
down (E, H, I) and a routing (indices, weights) of shape (N, k):
1. the N*k (token, slot) pairs are grouped by expert, ascending, and inside an
   expert by slot, then token: the rows HF's eager loop hands each expert, in
   its order (`torch.where` over the (slot, token) mask);
2. each expert e with at least one routed row runs on exactly those rows: its
   `gate_up[e]` and `down[e]` projections through the backend's row-invariant
   `linear`, the activation `silu(gate) * up` through the backend's invariant
   `silu` (the product in the model dtype); no expert is padded to the batch
   size, so memory does not grow with E beyond the weights;
3. every row is scaled by its routing weight as Hugging Face does it:
   `(y * w).to(model dtype)`, the product in the promoted dtype (bf16 x bf16
   for Qwen/OLMoE, bf16 x fp32 for Mixtral, whose weights stay fp32);
4. a token's k rows are added into a zero row in ascending expert index, in
   the model dtype, one rounding per add: the order and the roundings of HF's
   eager `index_add_` loop, with no atomics.
A token's rows depend only on its own hidden state and routing (the linear is
row-invariant), and the combine order only on its expert ids, so the result
is invariant in the batch, the other tokens' routing and the thread count.

Backward (plain torch, deterministic, not batch-invariant): per expert, plain
GEMMs in the parameters' dtype (as the linear op's backward), computed in fp32
and rounded once where this CPU has no bf16 GEMM instructions (`backward_mm`:
the same accuracy, 15-50x faster there); the gradient of
the hidden states is summed over a token's slots in the same fixed order as
the forward (never `index_add_`, which uses atomics on a GPU). With `spans=` and
`sink=`, the layout-invariant backward instead (common/moe_experts_sequences.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.kernels.common.checks import check_floating, check_index_range, check_same_dtype
from rl_engine.kernels.common.cpu_flags import backward_mm
from rl_engine.kernels.common.moe_experts_sequences import sequence_experts_backward
from rl_engine.kernels.common.op import Serving, define_op
from rl_engine.kernels.common.sequence_spans import check_sequence_mode, placeholder_grad


@dataclass(frozen=True)
class Grouping:
    """The (token, slot) pairs of one call, grouped by expert."""

    order: torch.Tensor
    """(S,) slot-major pair index j * N + t, sorted by expert (ascending), then by that index."""
    tokens: torch.Tensor
    """(S,) the token of each grouped row."""
    spans: tuple[tuple[int, int, int], ...]
    """(expert, start, stop) of every expert with rows, ascending: rows start:stop are its."""
    combine_rows: torch.Tensor
    """(N, k) the grouped rows of each token, in ascending expert order (the combine order)."""


def check_experts(hidden, gate_up, down, indices, weights) -> None:
    """hidden (N, H), gate_up (E, 2I, H), down (E, H, I), indices / weights (N, k)."""
    for name, t in (("hidden", hidden), ("gate_up", gate_up), ("down", down)):
        check_floating(name, t)
    check_floating("routing weights", weights)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (tokens, hidden), got shape {tuple(hidden.shape)}")
    if gate_up.dim() != 3 or gate_up.shape[1] % 2 or gate_up.shape[2] != hidden.shape[1]:
        raise ValueError(
            f"gate_up must be (num_experts, 2 * intermediate, hidden={hidden.shape[1]}), "
            f"got shape {tuple(gate_up.shape)}"
        )
    experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (experts, hidden.shape[1], width):
        raise ValueError(
            f"down must be (num_experts={experts}, hidden={hidden.shape[1]}, intermediate={width}), "
            f"got shape {tuple(down.shape)}"
        )
    check_same_dtype("hidden", hidden, "gate_up", gate_up)
    check_same_dtype("hidden", hidden, "down", down)
    if indices.dim() != 2 or indices.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"indices must be (tokens={hidden.shape[0]}, top_k), got shape {tuple(indices.shape)}"
        )
    if tuple(weights.shape) != tuple(indices.shape):
        raise ValueError(
            f"routing weights shape {tuple(weights.shape)} != indices shape {tuple(indices.shape)}"
        )
    check_index_range("expert indices", indices, experts, "the number of experts")


def group_by_expert(indices: torch.Tensor, num_experts: int) -> Grouping:
    """Group the (token, slot) pairs of indices (N, k) by expert (see `Grouping`)."""
    tokens, top_k = indices.shape
    flat = indices.t().reshape(-1)  # (S,) slot-major: pair j * N + t
    _, order = torch.sort(flat, stable=True)  # (S,): grouped row -> pair
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    spans, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
            start += count
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)  # pair -> grouped row
    # a token's grouped rows ascend with its expert ids (grouping is by expert first)
    combine_rows = position.view(top_k, tokens).t().sort(dim=1).values  # (N, k)
    return Grouping(order, order % max(tokens, 1), tuple(spans), combine_rows)


def combine(rows: torch.Tensor, combine_rows: torch.Tensor) -> torch.Tensor:
    """(S, H) grouped rows -> (N, H): zeros + row of the lowest expert + the next + ..."""
    out = rows.new_zeros((combine_rows.shape[0], rows.shape[1]))
    for slot in range(combine_rows.shape[1]):
        out += rows.index_select(0, combine_rows[:, slot])
    return out


def scale_rows(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's `(y * w[:, None]).to(dtype)`: the product in the promoted dtype, then one cast."""
    return (y * w[:, None]).to(dtype)


def expert_mlp(linear, silu, x, gate_up_e, down_e) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert on its rows: (gate_up output (n, 2I), down output (n, H)), model dtype."""
    gate_up_out = linear(x, gate_up_e)  # (n, 2I)
    gate, up = gate_up_out.chunk(2, dim=-1)  # (n, I) each
    return gate_up_out, linear(silu(gate) * up, down_e)


def composed_forward(linear, silu):
    """The forward of steps 1-4 on a backend's `linear` and `silu` ops, one expert at a time:
    forward(hidden, gate_up, down, indices, weights, keep) -> (out (N, H), saved or None)."""

    def forward(hidden, gate_up, down, indices, weights, keep: bool):
        grouping = group_by_expert(indices, gate_up.shape[0])
        pair_weights = weights.t().reshape(-1)[grouping.order]  # (S,)
        rows = grouping.order.numel()
        scaled = hidden.new_empty((rows, hidden.shape[1]))  # (S, H)
        saved_gate_up = hidden.new_empty((rows, gate_up.shape[1])) if keep else None
        saved_down = torch.empty_like(scaled) if keep else None
        for expert, start, stop in grouping.spans:
            x = hidden.index_select(0, grouping.tokens[start:stop])  # (n, H)
            gate_up_out, y = expert_mlp(linear, silu, x, gate_up[expert], down[expert])
            scaled[start:stop] = scale_rows(y, pair_weights[start:stop], hidden.dtype)
            if keep:
                saved_gate_up[start:stop], saved_down[start:stop] = gate_up_out, y
        out = combine(scaled, grouping.combine_rows)
        return out, ((grouping, saved_gate_up, saved_down) if keep else None)

    return forward


def silu_grad(gate: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d silu(gate) / d gate * grad in one pass (torch's fused SiLU backward: fp32 arithmetic for
    16-bit inputs, one rounding), in gate.dtype."""
    return torch.ops.aten.silu_backward(grad.to(gate.dtype), gate)


def experts_backward(grad_out, hidden, gate_up, down, weights, saved, silu, needs):
    """(grad hidden, grad gate_up, grad down, grad weights); `needs` = ctx.needs_input_grad.

    The elementwise steps run once over all S grouped rows (a row's arithmetic is its own, so
    this is the per-expert result in fewer, larger passes); only the GEMMs go expert by expert.
    """
    grouping, saved_gate_up, saved_down = saved
    dtype, width = hidden.dtype, gate_up.shape[1] // 2
    promoted = torch.promote_types(dtype, weights.dtype)
    pair_weights = weights.t().reshape(-1)[grouping.order].to(promoted)  # (S,)
    grad_scaled = grad_out.index_select(0, grouping.tokens).to(promoted)  # (S, H)
    grad_pairs = torch.linalg.vecdot(grad_scaled, saved_down.to(promoted)).to(weights.dtype)
    grad_y = (grad_scaled * pair_weights[:, None]).to(dtype)  # (S, H)
    del grad_scaled
    gate, up = saved_gate_up.chunk(2, dim=-1)  # (S, I) each
    act = silu(gate)  # the forward's activation, recomputed by the same op
    grad_act = torch.empty_like(act)  # (S, I): d loss / d (silu(gate) * up)
    for expert, start, stop in grouping.spans:
        backward_mm(grad_y[start:stop], down[expert], out=grad_act[start:stop])
    grad_gate_up_out = torch.empty_like(saved_gate_up)  # (S, 2I)
    grad_gate_up_out[:, :width] = silu_grad(gate, grad_act * up)
    torch.mul(grad_act, act, out=grad_gate_up_out[:, width:])
    del grad_act
    grad_down = _zero_unrouted_grad(down, grouping) if needs[2] else None
    if grad_down is not None:
        activation = act * up  # (S, I): the down projection's input
        for expert, start, stop in grouping.spans:
            backward_mm(grad_y[start:stop].t(), activation[start:stop], out=grad_down[expert])
        del activation
    del grad_y, act
    grad_gate_up = _zero_unrouted_grad(gate_up, grouping) if needs[1] else None
    if grad_gate_up is not None:
        x = hidden.index_select(0, grouping.tokens)  # (S, H)
        for expert, start, stop in grouping.spans:
            backward_mm(grad_gate_up_out[start:stop].t(), x[start:stop], out=grad_gate_up[expert])
        del x
    grad_hidden = None
    if needs[0]:
        grad_rows = torch.empty_like(saved_down)  # (S, H): d loss / d each grouped row's input
        for expert, start, stop in grouping.spans:
            backward_mm(grad_gate_up_out[start:stop], gate_up[expert], out=grad_rows[start:stop])
        grad_hidden = combine(grad_rows, grouping.combine_rows)
    grad_weights = torch.empty_like(grad_pairs)
    grad_weights[grouping.order] = grad_pairs  # slot-major (k * N,)
    return grad_hidden, grad_gate_up, grad_down, grad_weights.view(weights.shape[::-1]).t()


def _zero_unrouted_grad(param: torch.Tensor, grouping: Grouping) -> torch.Tensor:
    """The gradient buffer of a 3-D expert parameter: 0 for the experts without rows, the
    others left for their GEMM to write (no pass over the whole buffer first)."""
    grad = torch.empty_like(param)
    routed = torch.zeros(param.shape[0], dtype=torch.bool)
    for expert, _, _ in grouping.spans:
        routed[expert] = True
    grad[~routed.to(param.device)] = 0
    return grad


def invariant_experts_function(experts_forward, silu, module: str) -> type[torch.autograd.Function]:
    """`_InvariantExperts` of the backend `module`: its `experts_forward` (see `composed_forward`),
    the plain backward (which recomputes the activation with the backend's `silu`)."""

    class _InvariantExperts(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, gate_up, down, indices, weights):
            out, saved = experts_forward(hidden, gate_up, down, indices, weights, True)
            ctx.save_for_backward(hidden, gate_up, down, weights, saved[1], saved[2])
            ctx.grouping = saved[0]
            return out

        @staticmethod
        def backward(ctx, grad_out):
            hidden, gate_up, down, weights, saved_gate_up, saved_down = ctx.saved_tensors
            needs = (*ctx.needs_input_grad[:3], ctx.needs_input_grad[4])
            saved = (ctx.grouping, saved_gate_up, saved_down)
            g_hidden, g_gate_up, g_down, g_weights = experts_backward(
                grad_out, hidden, gate_up, down, weights, saved, silu, needs
            )
            return g_hidden, g_gate_up, g_down, None, g_weights if needs[3] else None

    _InvariantExperts.__module__, _InvariantExperts.__qualname__ = module, "_InvariantExperts"
    return _InvariantExperts


def sequence_experts_function(experts_forward, silu, gemm, module: str):
    """`_SequenceExperts` of the backend `module`: its forward, the layout-invariant backward
    (common/moe_experts_sequences.py) around its exact `gemm`."""

    class _SequenceExperts(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, gate_up, down, indices, weights, spans, sink):
            out, saved = experts_forward(hidden, gate_up, down, indices, weights, True)
            ctx.save_for_backward(hidden, weights, saved[1], saved[2])
            ctx.params, ctx.grouping, ctx.mode = (gate_up, down), saved[0], (spans, sink)
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            hidden, weights, saved_gate_up, saved_down = ctx.saved_tensors
            needs = (*ctx.needs_input_grad[:3], ctx.needs_input_grad[4])
            saved = (ctx.grouping, saved_gate_up, saved_down)
            g_hidden, g_weights = sequence_experts_backward(
                gemm,
                combine,
                grad_out,
                hidden,
                *ctx.params,
                weights,
                saved,
                silu,
                needs,
                *ctx.mode,
            )
            gate_up, down = ctx.params
            sink = ctx.mode[1]
            return (
                g_hidden if needs[0] else None,
                placeholder_grad(sink, gate_up, needs[1]),
                placeholder_grad(sink, down, needs[2]),
                None,
                g_weights if needs[3] else None,
                None,
                None,
            )

    _SequenceExperts.__module__, _SequenceExperts.__qualname__ = module, "_SequenceExperts"
    return _SequenceExperts


def moe_experts_op(experts_forward, silu, serving: Serving, module: str, gemm=None):
    """The public `moe_experts` of the backend `module`: its `experts_forward` (see
    `composed_forward`) and its unchecked `silu` (the backward recomputes the activation);
    `gemm` (its ExactGemm) serves the layout-invariant mode (None: the mode raises)."""
    function = invariant_experts_function(experts_forward, silu, module)
    sequence_function = (
        None if gemm is None else sequence_experts_function(experts_forward, silu, gemm, module)
    )

    def build(guard):
        def moe_experts(
            hidden: torch.Tensor,
            gate_up: torch.Tensor,
            down: torch.Tensor,
            indices: torch.Tensor,
            weights: torch.Tensor,
            *,
            spans=None,
            sink=None,
        ) -> torch.Tensor:
            """(N, H): each token's experts in ascending index, scaled by its weights and summed.

            hidden (N, H), gate_up (E, 2I, H), down (E, H, I), indices / weights (N, k).
            Without autograd the same forward runs directly (no autograd.Function).
            spans (over hidden's rows) and sink: the layout-invariant backward.
            """
            check_experts(hidden, gate_up, down, indices, weights)
            guard("hidden", hidden)
            sequence_mode = check_sequence_mode("moe_experts", spans, sink, hidden.shape[0])
            if sequence_mode and sequence_function is None:
                raise NotImplementedError(
                    f"moe_experts: backend {module} has no layout-invariant backward "
                    "(spans / sink); use the cpp backend"
                )
            tracked = hidden.requires_grad or gate_up.requires_grad or down.requires_grad
            if torch.is_grad_enabled() and (tracked or weights.requires_grad):
                if sequence_mode:
                    args = (hidden, gate_up, down, indices, weights, spans, sink)
                    return sequence_function.apply(*args)
                return function.apply(hidden, gate_up, down, indices, weights)
            return experts_forward(hidden, gate_up, down, indices, weights, False)[0]

        return moe_experts

    return define_op("moe_experts", module, serving, build)
