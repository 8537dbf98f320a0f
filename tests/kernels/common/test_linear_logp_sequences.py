"""`linear_logp`'s layout-invariant backward (common/linear_logp_sequences.py), called directly on
cpp's kernels with blocks of 3 rows.

Chain checked, with torch.equal: two sequences (one with an ignored target) laid out with
garbage padding between them == each alone in its own call, for every head-weight partial,
bias partial and grad-hidden row sent or returned; a sequence without a live target sends
zeros; an ignored or padding row's grad hidden is +0. Negative control: the same sequence cut
into one block instead of blocks of 3 gives a weight partial with other bits, so the cut
(which depends on the sequence and the vocabulary only) is what keeps them. A live target
outside every span is refused, naming its row.
"""

import pytest
import torch

from rl_engine.kernels.common.linear_logp_sequences import (
    check_targets_covered,
    sequence_logp_backward,
)
from rl_engine.kernels.common.sequence_spans import SequenceSpans
from rl_engine.kernels.cpp.linear import exact_gemm
from rl_engine.kernels.cpp.linear_logp import chunk_logprobs
from tests.helpers.kernels.sequence_backward import IGNORE, RecordingSink

VOCAB, HIDDEN, TEMPERATURE = 50, 16, 0.7


def _problem():
    g = torch.Generator().manual_seed(7)
    head = torch.randn(VOCAB, HIDDEN, generator=g) / 4
    bias = torch.randn(VOCAB, generator=g)
    first = (torch.randn(6, HIDDEN, generator=g), torch.randint(0, VOCAB, (6,), generator=g))
    first[1][2] = IGNORE
    second = (torch.randn(7, HIDDEN, generator=g), torch.randint(0, VOCAB, (7,), generator=g))
    coeff = torch.randn(13, generator=g)
    return head, bias, first, second, coeff


def _backward(hidden, targets, coeff, head, bias, spans, block_rows=3):
    sink = RecordingSink()
    grad_hidden = sequence_logp_backward(
        chunk_logprobs,
        lambda vocab: block_rows,
        exact_gemm,
        coeff,
        hidden,
        head,
        bias,
        targets,
        TEMPERATURE,
        IGNORE,
        spans,
        sink,
        needs=(True, True, True),
    )
    return grad_hidden, sink.records


def test_a_sequences_gradients_do_not_depend_on_the_layout():
    head, bias, (h1, t1), (h2, t2), coeff = _problem()
    garbage = torch.randn(2, HIDDEN) * 1e4
    hidden = torch.cat([h1, garbage, h2])  # rows 0..5, padding 6..7, rows 8..14
    targets = torch.cat([t1, torch.full((2,), IGNORE), t2])
    grad_out = torch.cat([coeff[:6], torch.randn(2), coeff[6:]])
    spans = SequenceSpans(15, (0, 8), (6, 7), (4, 9))
    grad, records = _backward(hidden, targets, grad_out, head, bias, spans)
    grad1, alone1 = _backward(h1, t1, coeff[:6], head, bias, SequenceSpans(6, (0,), (6,), (4,)))
    grad2, alone2 = _backward(h2, t2, coeff[6:], head, bias, SequenceSpans(7, (0,), (7,), (9,)))
    assert records.keys() == alone1.keys() | alone2.keys()
    for key, value in {**alone1, **alone2}.items():
        assert torch.equal(records[key], value), key
    assert torch.equal(grad[:6], grad1) and torch.equal(grad[8:], grad2)
    zero_rows = torch.cat([grad[2], grad[6:8].reshape(-1)])  # the ignored target, the padding
    assert not zero_rows.any() and not zero_rows.signbit().any()


def test_negative_control_another_cut_gives_other_bits():
    head, bias, (h1, t1), _, coeff = _problem()
    spans = SequenceSpans(6, (0,), (6,), (4,))
    _, blocks = _backward(h1, t1, coeff[:6], head, bias, spans)
    _, one_block = _backward(h1, t1, coeff[:6], head, bias, spans, block_rows=8)
    assert not torch.equal(blocks[("lm_head", 4)], one_block[("lm_head", 4)])


def test_a_sequence_without_a_live_target_sends_zeros():
    head, bias, (h1, t1), _, coeff = _problem()
    targets = torch.cat([torch.full((3,), IGNORE), t1[3:]])
    spans = SequenceSpans(6, (0, 3), (3, 3), (1, 2))
    _, records = _backward(h1, targets, coeff[:6], head, bias, spans)
    assert torch.equal(records[("lm_head", 1)], torch.zeros(VOCAB, HIDDEN))
    assert torch.equal(records[("bias", 1)], torch.zeros(VOCAB))
    assert records[("lm_head", 2)].any()


def test_a_live_target_outside_every_span_is_named():
    targets = torch.tensor([1, IGNORE, 4, 2])
    check_targets_covered(SequenceSpans(4, (0, 2), (1, 2), (0, 1)), targets, IGNORE)
    with pytest.raises(
        ValueError, match=r"linear_logp: row 2 .* lies in no sequence of spans \(2 such"
    ):
        check_targets_covered(SequenceSpans(4, (0,), (2,), (0,)), targets, IGNORE)
