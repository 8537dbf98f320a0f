"""A step's gradient handed to DeepSpeed without DeepSpeed's reduction, and its layout-free norm.

`whole_gradients` forms each parameter's whole gradient on every rank: every rank broadcasts
its cover of the canonical tree (rl_engine/exact/canonical_sum.py: the maximal tree nodes inside its
contiguous range of the step's sequences; every rank knows every range, so it knows every
cover's shape) and every rank evaluates the root from all of them, role by role, then adds
the roles (`sum_roles`). The adds are the tree's, so the rank count does not enter.

In layout-invariant mode the worker forms each parameter's whole gradient itself (the same bits
on every rank, whatever the rank count, ZeRO stage or micro-batching) and DeepSpeed only keeps
its partition and steps it: `inject_gradients` writes each parameter's gradient into the
partition DeepSpeed holds for it (its fragment accessors, valid for ZeRO 0-3 and the bf16
optimizer, between a backward and `step`), rounded once to the parameter's dtype, as the plain
path's gradients are.

`global_norm` is the clip's norm computed from the whole gradients in one fixed order: squares
summed in fp64 (a float32 square is exact there) over rows of `NORM_ROW` elements of each
parameter, then every row sum added exactly (`exact_sum`, correctly rounded whatever the order).
torch reduces a row that short on one thread, in an order set by its length alone, and every
layout calls it on the same whole gradients, so no partition, rank count or thread count enters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from deepspeed.utils import safe_set_full_grad

from rl_engine.exact.canonical_sum import Node, combine, cover, sum_roles
from rl_engine.exact.float_sums import exact_sum
from rl_engine.exact.row_partial import RowPartial
from rl_engine.exact.sequence_gradients import SequenceGradients
from rl_engine.kernels.common.product_partial import dense

NORM_ROW = 4096
NORM_ROWS_AT_ONCE = 256  # 8 MiB of fp64 squares


class GradientInjectionError(RuntimeError):
    """DeepSpeed holds no gradient partition for a parameter (no backward since the last step)."""


def whole_gradients(
    sink: SequenceGradients, params: Sequence[torch.nn.Parameter], ranges: Sequence[tuple[int, int]]
) -> list[torch.Tensor]:
    """Each of `params`' whole fp32 gradient, the same bits on every rank (collective).

    `sink` holds this rank's partials of [lo, hi) = ranges[rank] of the step's sink.n sequences;
    `ranges` are every rank's (contiguous, in rank order, together [0, n))."""
    return [whole_gradient(sink, param, ranges) for param in params]


def whole_gradient(
    sink: SequenceGradients, param: torch.nn.Parameter, ranges: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """`whole_gradients` of one parameter (collective: every rank calls it for the same
    parameters in the same order)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tuple(ranges[rank]) != (sink.lo, sink.hi):
        raise ValueError(f"rank {rank} holds [{sink.lo}, {sink.hi}), ranges say {ranges[rank]}")
    shape = tuple(getattr(param, "ds_shape", param.shape))
    dtype = _partial_dtype(param)
    mine = sink.nodes(param)
    roots = {}
    for role in sorted(mine):
        # an embedding's cover travels as its rows (a RowPartial adds as its dense form would)
        rows_only = isinstance(mine[role][0].value, RowPartial)
        nodes = []
        for source, (lo, hi) in enumerate(ranges):
            held = {(node.lo, node.hi): node.value for node in mine[role]} if source == rank else {}
            for a, b in cover(sink.n, lo, hi):
                value = held[(a, b)] if held else None
                if rows_only:
                    value = _broadcast_rows(value, shape, dtype, source)
                else:
                    value = _broadcast(
                        None if value is None else dense(value), shape, dtype, source
                    )
                nodes.append(Node(a, b, value))
        roots[role] = combine(sink.n, nodes)
    return sum_roles(shape, roots)


def _partial_dtype(param) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _broadcast(value: torch.Tensor | None, shape, dtype, source: int) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    buffer = value if value is not None else torch.empty(shape, dtype=dtype)
    dist.broadcast(buffer, src=source)
    return buffer


def _broadcast_rows(value: RowPartial | None, shape, dtype, source: int) -> RowPartial:
    """`_broadcast` of a RowPartial: its row count, then its rows and their values."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    count = torch.tensor([0 if value is None else value.rows.numel()])
    dist.broadcast(count, src=source)
    if value is not None:
        rows, values = value.rows, value.values.contiguous()
    else:
        rows = torch.empty(int(count), dtype=torch.int64)
        values = torch.empty((int(count), *shape[1:]), dtype=dtype)
    if rows.numel():
        dist.broadcast(rows, src=source)
        dist.broadcast(values, src=source)
    return value if value is not None else RowPartial(rows, values)


def inject_gradients(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
    """Write `grads[i]` (the whole gradient of `params[i]`) into DeepSpeed's partition of it."""
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        inject_gradient(param, grad, index)


def inject_gradient(param: torch.nn.Parameter, grad: torch.Tensor, index: int = 0) -> None:
    """`inject_gradients` of one parameter (`index` names it in errors)."""
    shape = tuple(getattr(param, "ds_shape", param.shape))
    if tuple(grad.shape) != shape:
        raise ValueError(f"gradient {index} has shape {tuple(grad.shape)}, its parameter {shape}")
    if hasattr(param, "ds_id"):
        # ZeRO-3 holds the gradient in its partition; a .grad here is one DeepSpeed did not
        # reduce (layout-invariant ranks mark every parameter not ready: its hooks skip them),
        # such as the zeros its leaf-module hook gives a MoE expert without a gradient
        param.grad = None
    elif param.grad is None and not hasattr(param, "_hp_mapping"):
        # DeepSpeed's safe_set_full_grad writes nothing for such a parameter, and says nothing
        raise GradientInjectionError(
            f"parameter {index} {shape}: neither a .grad nor a DeepSpeed gradient partition to "
            "write into; it is not a parameter of a DeepSpeed engine's optimizer"
        )
    try:
        safe_set_full_grad(param, _padded_for_zero3(param, grad.to(param.dtype)))
    except ValueError as err:  # DeepSpeed: "only available immediately after backward"
        raise GradientInjectionError(
            f"parameter {index} {shape}: DeepSpeed has no gradient partition to write ({err}); "
            "run the step's backward first"
        ) from None


def _padded_for_zero3(param, grad: torch.Tensor) -> torch.Tensor:
    """ZeRO-3 cuts a parameter into equal partitions, the last one padded, and slices the whole
    gradient by those padded offsets: give it the padding (zeros) to slice."""
    if not hasattr(param, "ds_tensor"):
        return grad
    padded = param.ds_tensor.numel() * torch.distributed.get_world_size()
    flat = grad.reshape(-1)
    if padded == flat.numel():  # no padding: no copy
        return flat
    return torch.nn.functional.pad(flat, (0, padded - flat.numel()))


def global_norm(grads: Iterable[torch.Tensor]) -> float:
    """The L2 norm of all `grads` together (pass them as they will be injected: rounded to the
    parameters' dtype)."""
    return math.sqrt(exact_sum(part for grad in grads for part in row_square_sums(grad)))


def row_square_sums(grad: torch.Tensor) -> list[float]:
    """`global_norm`'s terms of one gradient: the fp64 sums of squares of its rows (their
    `math.fsum` with every other gradient's, in any order, is the squared norm). Formed
    `NORM_ROWS_AT_ONCE` rows at a time, so the fp64 squares of a large gradient (the
    embedding's: 4x its fp32 size) never exist whole; a row's sum is the same either way."""
    flat = grad.detach().reshape(-1)
    rows, tail = divmod(flat.numel(), NORM_ROW)
    sums = []
    for first in range(0, rows, NORM_ROWS_AT_ONCE):
        last = min(rows, first + NORM_ROWS_AT_ONCE)
        block = flat[first * NORM_ROW : last * NORM_ROW].to(torch.float64)
        sums += block.mul_(block).view(last - first, NORM_ROW).sum(dim=1).tolist()
    if tail:
        block = flat[rows * NORM_ROW :].to(torch.float64)
        sums.append(float(block.mul_(block).sum()))
    return sums


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor the gradients are scaled by, as torch's clip_grad_norm_ forms it (None: no clip)."""
    if max_norm <= 0.0 or not norm == norm or norm <= max_norm:  # off, NaN or within the bound
        return None
    return max_norm / (norm + 1e-6)
