"""SequenceSpans and the layout-invariant mode's interface: builders, and errors that name the value.

The mode's arithmetic and its layout tests: test_sequence_backward.py.
"""

import pytest
import torch

from rl_engine.kernels import SequenceSpans, get_op
from rl_engine.kernels.common.linear import linear_op, projection
from rl_engine.kernels.cpp._serving import GEMM
from rl_engine.kernels.cpp.linear import linear_forward
from tests.helpers.kernels.sequence_backward import RecordingSink


def test_spans_from_a_padding_mask_and_from_segments():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 0]])
    spans = SequenceSpans.from_padding_mask(mask, [5, 2, 9])
    assert spans == SequenceSpans(9, (3, 1, 6), (2, 2, 0), (2, 5, 9))  # by canonical index
    segments = torch.tensor([[0, 0, 1, -1], [2, 2, 2, -1]])
    assert SequenceSpans.from_segments(segments) == SequenceSpans(
        8, (0, 2, 4), (2, 1, 3), (0, 1, 2)
    )
    assert spans.covered().tolist() == [False, True, True, True, True, False, False, False, False]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SequenceSpans.from_padding_mask(torch.tensor([[1, 0, 1]])), "mask row 0"),
        (lambda: SequenceSpans.from_padding_mask(torch.ones(2, 3), [4, 4]), "must increase"),
        (lambda: SequenceSpans.from_padding_mask(torch.ones(2, 3), [1]), "indices: got 1"),
        (lambda: SequenceSpans.from_segments(torch.tensor([[0, 1, 0]])), "sequence 0"),
        (lambda: SequenceSpans.from_segments(torch.tensor([[0, -2]])), "got -2"),
        (lambda: SequenceSpans(4, (0, 2), (3, 2), (0, 1)), "overlap"),
        (lambda: SequenceSpans(4, (3,), (2,), (0,)), "does not lie in rows"),
    ],
)
def test_bad_spans_raise_naming_the_value(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_mode_fails_closed():
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    spans = SequenceSpans.from_padding_mask(torch.ones(2, 3))
    linear = get_op("linear", "cpu")
    with pytest.raises(ValueError, match="spans is given but sink is None"):
        linear(x, w, spans=spans)
    with pytest.raises(ValueError, match="spans describe 6 rows but the input has 3"):
        linear(x[0], w, spans=spans, sink=RecordingSink())
    without_mode = linear_op(projection(linear_forward, __name__), GEMM, __name__)
    with pytest.raises(NotImplementedError, match="no layout-invariant backward"):
        without_mode(x, w, spans=spans, sink=RecordingSink())
    targets = torch.tensor([[1, 2, 3], [0, 1, 2]])
    half = SequenceSpans.from_padding_mask(torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match="row 3 .* has a live target but lies in no sequence"):
        get_op("linear_logp", "cpu")(x, w, targets, spans=half, sink=RecordingSink())


class _SinkWithoutPlaceholders:
    """A sink that forgets to declare `placeholder_grads`."""

    def add(self, param, role, index, partial):
        pass

    def add_rows(self, param, role, index, rows, values):
        pass


@pytest.mark.parametrize("placeholders", [False, True])
def test_the_sink_says_whether_a_parameter_gets_a_placeholder_gradient(placeholders):
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    spans = SequenceSpans.from_padding_mask(torch.ones(2, 3))
    sink = RecordingSink()
    sink.placeholder_grads = placeholders
    get_op("linear", "cpu")(x, w, spans=spans, sink=sink).sum().backward()
    if placeholders:
        assert torch.equal(w.grad, torch.zeros_like(w))
    else:
        assert w.grad is None


def test_a_sink_that_does_not_declare_placeholder_grads_fails_the_backward():
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    spans = SequenceSpans.from_padding_mask(torch.ones(2, 3))
    out = get_op("linear", "cpu")(x, w, spans=spans, sink=_SinkWithoutPlaceholders())
    with pytest.raises(AttributeError, match="placeholder_grads"):
        out.sum().backward()
