"""The layout-invariant backward's arithmetic, written once around a backend's exact GEMM.

Every reduction here runs in an order fixed by one sequence's own rows (or by one
token's row), never by the call's row count, its padding, packing or thread count:

- `ExactGemm`, the backend's: a (M, K) @ b (N, K)^T -> (M, N) in fp32 (fp64 for fp64)
  where output row m is a function of a[m], b, K and N alone, summed in at least fp32,
  whatever M, a's other rows, the operands' addresses or the thread count. cpp: its
  forward's kernels (`serialk-v1`), each output one chain from +0, fp32 acc =
  fma(a[m, k], b[n, k], acc) for k = 0, 1, ..., K-1, bf16 by pairs, odd element first,
  products exact; native: its fixed-shape tile scheme in fp32, under its platform
  probe. Its operands arrive in the parameter's dtype (the upstream gradient rounded to
  it where it is wider, as the plain backward does).
- input gradients: `input_grad` = grad_out @ W, one chain over the output features
  per (row, input feature), rounded once to the input's dtype: row-invariant.
- weight partials: `weight_partials` = dy_s^T x_s per sequence s, one chain over the
  sequence's rows in increasing order.
- sums of rows (a bias, a norm's weight, an embedding row): `row_sums`, acc = +0,
  then acc = acc + v[row] for the sequence's rows in increasing order.

A chain that starts at +0 never holds -0 (x + y is -0 only when both are -0), so
adding an exact +0 or -0 anywhere along it is a no-op: `row_sums` pads shorter
sequences with +0, and a row whose upstream gradient is zero adds nothing to a GEMM
chain while its other operand is finite (so `linear_logp` defines rows without a
target as skipped: the bits of including them, for finite hidden states).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.nn.utils.rnn import pad_sequence

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.sequence_spans import SequenceSpans

# a (M, K), b (N, K), both in the parameter's dtype -> (M, N) fp32 (fp64): see above
ExactGemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def transposed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t (M, C) -> a contiguous (C, M) copy in `dtype`."""
    return t.to(dtype).t().contiguous()


def input_grad(
    gemm: ExactGemm, grad_out: torch.Tensor, weight_t: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """grad_out (M, N) @ weight (N, K) -> (M, K) in `dtype`; weight_t is `transposed(weight,
    weight.dtype)` (K, N)."""
    if grad_out.shape[0] == 0:  # no rows (a kernel call needs one)
        return grad_out.new_zeros((0, weight_t.shape[0]), dtype=dtype)
    return gemm(grad_out.to(weight_t.dtype), weight_t).to(dtype)


def weight_partials(
    gemm: ExactGemm, grad_out: torch.Tensor, x: torch.Tensor, spans: SequenceSpans
) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, dy_s^T x_s (N, K)) per sequence, in span order; grad_out (M, N), x (M, K).

    Each sequence's operands are transposed into fresh contiguous buffers: column slices
    of one transposed batch give the kernel rows a batch-wide stride (4 KiB at 1024 rows),
    which ran 2.7x slower here (cache-set conflicts); the bits are the same either way.
    Operands in x's dtype (the parameter's)."""
    for i, index in enumerate(spans.indices):
        start, stop = spans.starts[i], spans.starts[i] + spans.lengths[i]
        if start == stop:  # no rows: the empty chain, +0 (never a K = 0 GEMM call)
            shape = (grad_out.shape[1], x.shape[1])
            yield index, torch.zeros(shape, dtype=at_least_fp32(x.dtype), device=x.device)
            continue
        dy_t, x_t = transposed(grad_out[start:stop], x.dtype), transposed(x[start:stop], x.dtype)
        yield index, gemm(dy_t, x_t)


def row_sums(
    values: torch.Tensor, rows: list[torch.Tensor], init: torch.Tensor | None = None
) -> torch.Tensor:
    """(S, C): out[s] = init[s] (else +0), then + values[r] for r in rows[s], in order.

    values (M, C) in the accumulation dtype; rows[s] an int64 tensor of row ids. All
    sequences advance together, one row each per step (a sequence out of rows adds +0, a
    no-op on a chain from +0), so each chain is its own sequence's; the rows of up to
    M / S steps are gathered at once (memory: at most one more `values`).
    """
    out = (
        torch.zeros((len(rows), values.shape[1]), dtype=values.dtype, device=values.device)
        if init is None
        else init.clone()
    )
    live = [s for s, r in enumerate(rows) if r.numel()]
    if not live:
        return out
    table = pad_sequence([rows[s] for s in live], batch_first=True, padding_value=-1)  # (S', L)
    table = table.to(values.device)
    which = torch.tensor(live, device=values.device)
    acc = out[which]  # (S', C)
    width = max(1, values.shape[0] // len(live))
    for first in range(0, table.shape[1], width):
        ids = table[:, first : first + width]  # (S', w)
        picked = torch.where((ids >= 0)[..., None], values[ids.clamp(min=0)], 0.0)  # (S', w, C)
        for step in range(ids.shape[1]):
            acc += picked[:, step]
    out[which] = acc
    return out


def span_rows(spans: SequenceSpans) -> list[torch.Tensor]:
    """Each sequence's row ids, in order (the `rows` of `row_sums`)."""
    return [torch.arange(start, start + n) for start, n in zip(spans.starts, spans.lengths)]


def embedding_partials(
    ids: torch.Tensor, grad: torch.Tensor, spans: SequenceSpans, padding_idx: int | None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(index, rows, values) per sequence: rows the sorted unique token ids of its tokens (those
    equal to padding_idx left out: their gradient is zero, as torch's embedding gives), values
    (len(rows), H) in the accumulation dtype: for each id, +0 then + the upstream gradient row
    of each of its tokens, in token order. ids (M,), grad (M, H)."""
    acc = at_least_fp32(grad.dtype)
    grad = grad.to(acc)
    ids = ids.to("cpu").long()
    for i, index in enumerate(spans.indices):
        start, stop = spans.starts[i], spans.starts[i] + spans.lengths[i]
        tokens = torch.arange(start, stop)
        seq_ids = ids[start:stop]
        if padding_idx is not None:
            tokens, seq_ids = tokens[seq_ids != padding_idx], seq_ids[seq_ids != padding_idx]
        rows, slot = torch.unique(seq_ids, sorted=True, return_inverse=True)
        # the tokens of each id, in token order: a stable sort by id keeps it
        order = torch.sort(slot, stable=True).indices
        per_id = torch.split(tokens[order], torch.bincount(slot, minlength=rows.numel()).tolist())
        yield index, rows.to(grad.device), row_sums(grad, list(per_id))
