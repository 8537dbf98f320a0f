"""The `moe_router` op, written once: everything but the logits' projection (and triton's routing kernel).

Contract (docs/operators.md#moe_router): router logits = the backend's invariant
`linear(hidden, weight)` in the model dtype; probabilities = softmax over the
experts in fp32, one row at a time; the top-k is a pure function of the row:
the k largest probabilities in descending order, equal probabilities ordered
by ascending expert index (so ties go to the LOWEST index, whatever the batch);
optional renormalisation divides by their sum taken in a fixed order (slot 0,
then 1, ...); the weights are finally cast to `weights_dtype` (the logits'
dtype unless asked otherwise: HF casts back, except Mixtral, which keeps fp32).

`torch.topk` is not used: the order in which it returns equal values is not
specified (it depends on the kernel, the row length and the device). A stable
descending sort has a specified order. torch's last-dim softmax works on one
row at a time, in an order set by the row length only (the same fact the
`log_softmax` op rests on; tests/kernels/common/test_moe_router.py checks it for 1 to
4096 rows, test_moe_experts.py for 1 to 3 threads).

Backward (plain torch, deterministic): through the renormalisation, the gather and
the softmax, to the logits (row by row, so row-invariant); the logits' backward is the
linear op's own, with `spans=` / `sink=` its layout-invariant one (the router weight's
role: "moe_router").
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_floating, check_last_dim, check_same_dtype
from rl_engine.kernels.common.op import Serving, define_op


def check_router(hidden: torch.Tensor, weight: torch.Tensor, top_k: int) -> None:
    """hidden (..., H) against weight (E, H); 1 <= top_k <= E."""
    check_floating("hidden", hidden)
    check_floating("router weight", weight)
    if weight.dim() != 2:
        raise ValueError(
            f"router weight must be 2-D (num_experts, hidden), got shape {tuple(weight.shape)}"
        )
    check_last_dim("hidden", hidden, weight.shape[1], "the router weight's hidden size")
    check_same_dtype("hidden", hidden, "router weight", weight)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= weight.shape[0]:
        raise ValueError(
            f"top_k must be an int in [1, num_experts={weight.shape[0]}], got {top_k!r}"
        )


def router_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """(N, E) logits -> fp32 (fp64 for fp64) softmax over the experts, row by row."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits, dim=-1, dtype=acc)


def select_top_k(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (N, k), indices (N, k) int64): descending, equal values by ascending expert index."""
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :top_k].contiguous(), indices[:, :top_k].contiguous()


def fixed_order_sum(values: torch.Tensor) -> torch.Tensor:
    """(N, k) -> (N, 1): ((v0 + v1) + v2) + ..., the same order for every row and batch."""
    total = values[:, :1].clone()
    for slot in range(1, values.shape[1]):
        total += values[:, slot : slot + 1]
    return total


def routing_forward(logits, top_k, renormalize, weights_dtype):
    """(weights (N, k) weights_dtype, indices (N, k), probs (N, E), total (N, 1) or None)."""
    probs = router_probabilities(logits)  # (N, E) fp32
    values, indices = select_top_k(probs, top_k)  # (N, k)
    total = None
    if renormalize:
        total = fixed_order_sum(values)
        values = values / total
    return values.to(weights_dtype), indices, probs, total


def routing_backward(grad_weights, probs, indices, weights, total):
    """d loss / d logits (N, E) fp32 from d loss / d weights (N, k)."""
    grad_values = grad_weights.to(probs.dtype)  # (N, k)
    if total is not None:  # w = v / sum(v): dv = (dw - sum(dw * w)) / sum(v)
        w = weights.to(probs.dtype)
        grad_values = (grad_values - (grad_values * w).sum(-1, keepdim=True)) / total
    grad_probs = torch.zeros_like(probs).scatter_(1, indices, grad_values)  # (N, E)
    return probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))


class _TopKRouting(torch.autograd.Function):
    """logits (N, E) -> (weights (N, k), indices (N, k)); backward to the logits."""

    @staticmethod
    def forward(ctx, logits, top_k, renormalize, weights_dtype, route):
        weights, indices, probs, total = route(logits, top_k, renormalize, weights_dtype)
        ctx.save_for_backward(probs, indices, weights, *(() if total is None else (total,)))
        ctx.renormalize, ctx.logits_dtype = renormalize, logits.dtype
        ctx.mark_non_differentiable(indices)
        return weights, indices

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices):
        probs, indices, weights, *total = ctx.saved_tensors
        grad = routing_backward(grad_weights, probs, indices, weights, total[0] if total else None)
        return grad.to(ctx.logits_dtype), None, None, None, None


def route_tokens(
    project, hidden, weight, top_k, renormalize, weights_dtype, route, spans=None, sink=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op after its checks: logits through the backend's `project` (a common.linear
    Projection; with spans and a sink, its layout-invariant backward), then `route`
    (`routing_forward`, or the backend's own routing kernel)."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    logits = project(hidden2d, weight, spans=spans, sink=sink, role="moe_router")  # (N, E)
    out_dtype = logits.dtype if weights_dtype is None else weights_dtype
    if hidden2d.shape[0] == 0:
        empty = logits.new_zeros((0, top_k), dtype=out_dtype) + logits.sum() * 0
        return logits, empty, torch.zeros((0, top_k), dtype=torch.long, device=logits.device)
    if torch.is_grad_enabled() and logits.requires_grad:
        weights, indices = _TopKRouting.apply(logits, top_k, renormalize, out_dtype, route)
    else:  # inference (rollout decode): the same forward, without the autograd.Function
        weights, indices, _, _ = route(logits, top_k, renormalize, out_dtype)
    return logits, weights, indices


def moe_router_op(project, serving: Serving, module: str, route=routing_forward):
    """The public `moe_router` of the backend `module`: logits through its `project`, then
    `route` (default: the plain-torch `routing_forward`)."""

    def build(guard):
        def moe_router(
            hidden: torch.Tensor,
            weight: torch.Tensor,
            top_k: int,
            *,
            renormalize: bool = False,
            weights_dtype: torch.dtype | None = None,
            spans=None,
            sink=None,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """hidden (..., H), router weight (E, H) -> (logits (N, E) in hidden's dtype,
            weights (N, k) in weights_dtype or the logits' dtype, indices (N, k) int64).
            spans (over hidden's flattened rows) and sink: the layout-invariant backward."""
            check_router(hidden, weight, top_k)
            guard("hidden", hidden)
            project.check_sequence_mode("moe_router", hidden, spans, sink)
            return route_tokens(
                project, hidden, weight, top_k, renormalize, weights_dtype, route, spans, sink
            )

        return moe_router

    return define_op("moe_router", module, serving, build)
