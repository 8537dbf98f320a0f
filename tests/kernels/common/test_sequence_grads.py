"""The layout-invariant backward's arithmetic (common/sequence_grads.py), around cpp's exact GEMM.

Checked, with torch.equal: `row_sums` is, per sequence, +0 (or its init) then + each of its
rows in order, gathered a few steps at a time (negative control: the reverse order gives
other bits); `weight_partials` yields each sequence's dy_s^T x_s as the GEMM of its own
transposed rows, in span order, and +0 for a sequence without rows; `input_grad` is the GEMM
of grad_out in the weight's dtype, rounded once to the asked dtype, each row that of the row
alone (the negative control of a plain batched backward: tests/kernels/test_sequence_backward.py);
`embedding_partials` gives each sequence its sorted unique ids (padding_idx left out) and, per
id, the sum of its tokens' upstream rows in token order.
"""

import torch

from rl_engine.kernels.common.sequence_grads import (
    embedding_partials,
    input_grad,
    row_sums,
    span_rows,
    transposed,
    weight_partials,
)
from rl_engine.kernels.common.sequence_spans import SequenceSpans
from rl_engine.kernels.cpp.linear import exact_gemm

# rows 0..3 are sequence 5, rows 4..5 padding, rows 6..15 sequence 9; sequence 12 has no rows
SPANS = SequenceSpans(16, (0, 6, 16), (4, 10, 0), (5, 9, 12))


def _wide(*shape, seed):
    """Values over many magnitudes, so that a sum's order shows in its bits."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-6, 7, shape, generator=g)
    return torch.randn(*shape, generator=g) * scale


def _chain(values, rows, start):
    acc = start.clone()
    for r in rows:
        acc = acc + values[r]
    return acc


def test_row_sums_add_each_sequences_rows_in_order_from_zero_or_init():
    values = _wide(16, 3, seed=0)
    rows = span_rows(SPANS)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], list(range(6, 16)), []]
    got = row_sums(values, rows)  # 16 rows / 2 live sequences: 8 steps gathered at a time
    for s, r in enumerate(rows):
        assert torch.equal(got[s], _chain(values, r.tolist(), torch.zeros(3))), f"sequence {s}"
    init = _wide(3, 3, seed=1)
    got = row_sums(values, rows, init)
    assert torch.equal(got[1], _chain(values, rows[1].tolist(), init[1]))
    assert torch.equal(got[2], init[2])


def test_negative_control_the_reverse_order_gives_other_bits():
    values = _wide(16, 64, seed=2)
    rows = span_rows(SPANS)[1]
    forward = _chain(values, rows.tolist(), torch.zeros(64))
    assert not torch.equal(forward, _chain(values, rows.flip(0).tolist(), torch.zeros(64)))


def test_weight_partials_are_each_sequences_own_gemm():
    g = torch.Generator().manual_seed(3)
    grad_out, x = torch.randn(16, 5, generator=g), torch.randn(16, 7, generator=g)
    partials = list(weight_partials(exact_gemm, grad_out, x, SPANS))
    assert [index for index, _ in partials] == [5, 9, 12]
    for (_, got), start, length in zip(partials, SPANS.starts, SPANS.lengths):
        rows = slice(start, start + length)
        if length == 0:
            assert torch.equal(got, torch.zeros(5, 7)) and not got.signbit().any()
            continue
        assert torch.equal(
            got, exact_gemm(grad_out[rows].t().contiguous(), x[rows].t().contiguous())
        )
        ref = grad_out[rows].double().t() @ x[rows].double()
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_input_grad_rows_are_their_own_and_rounded_once():
    g = torch.Generator().manual_seed(4)
    grad_out = torch.randn(9, 6, generator=g)  # fp32, wider than the bf16 weight
    weight = torch.randn(6, 11, generator=g).bfloat16()
    weight_t = transposed(weight, weight.dtype)
    assert weight_t.is_contiguous() and torch.equal(weight_t, weight.t())
    got = input_grad(exact_gemm, grad_out, weight_t, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 11)
    assert torch.equal(got, exact_gemm(grad_out.bfloat16(), weight_t).bfloat16())
    alone = torch.cat(
        [input_grad(exact_gemm, grad_out[m : m + 1], weight_t, torch.bfloat16) for m in range(9)]
    )
    assert torch.equal(got, alone)
    empty = input_grad(exact_gemm, grad_out[:0], weight_t, torch.float32)
    assert empty.shape == (0, 11) and empty.dtype == torch.float32


def test_embedding_partials_sum_each_ids_tokens_in_token_order():
    ids = torch.tensor([3, 1, 3, 0, 0, 0, 2, 3, 2, 2, 0, 2, 3, 1, 2, 3])  # 0 is padding_idx
    grad = _wide(16, 4, seed=5).bfloat16()
    out = list(embedding_partials(ids, grad, SPANS, padding_idx=0))
    assert [index for index, _, _ in out] == [5, 9, 12]
    for (_, rows, values), start, length in zip(out, SPANS.starts, SPANS.lengths):
        tokens = [t for t in range(start, start + length) if ids[t] != 0]
        assert rows.tolist() == sorted({int(ids[t]) for t in tokens})
        assert values.dtype == torch.float32 and values.shape == (rows.numel(), 4)
        for j, token_id in enumerate(rows.tolist()):
            mine = [t for t in tokens if ids[t] == token_id]
            assert torch.equal(values[j], _chain(grad.float(), mine, torch.zeros(4)))
