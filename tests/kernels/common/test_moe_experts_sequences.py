"""`moe_experts`' layout-invariant backward (common/moe_experts_sequences.py), called directly on
cpp's kernels.

Chain checked, with torch.equal: two sequences of tokens with a garbage padding token between
them == each sequence alone in its own call, for every expert partial it sends (roles
"moe_gate_up" and "moe_down", the sorted experts its pairs were routed to) and for its tokens'
hidden and routing-weight gradients. Negative control: counting the padding token into the
first sequence changes that sequence's partials, so the padding's absence is what the equality
checks.
"""

import torch

from rl_engine.kernels.common.moe_experts import combine
from rl_engine.kernels.common.moe_experts_sequences import sequence_experts_backward
from rl_engine.kernels.common.sequence_spans import SequenceSpans
from rl_engine.kernels.cpp.linear import exact_gemm
from rl_engine.kernels.cpp.moe_experts import experts_forward
from rl_engine.kernels.cpp.silu import silu_forward
from tests.helpers.kernels.moe import experts_weights, randn
from tests.helpers.kernels.sequence_backward import RecordingSink

EXPERTS, HIDDEN, WIDTH = 4, 12, 6


def _tokens():
    g = torch.Generator().manual_seed(31)
    hidden = randn(6, HIDDEN, seed=32)
    hidden[3] = randn(HIDDEN, seed=33, scale=1e4)  # the padding token
    indices = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=g)
    return hidden, indices, weights, randn(6, HIDDEN, seed=34)


def _backward(hidden, indices, weights, grad_out, spans):
    gate_up, down = experts_weights(torch.float32, EXPERTS, HIDDEN, WIDTH)
    _, saved = experts_forward(hidden, gate_up, down, indices, weights, True)
    sink = RecordingSink()
    grads = sequence_experts_backward(
        exact_gemm,
        combine,
        grad_out,
        hidden,
        gate_up,
        down,
        weights,
        saved,
        silu_forward,
        (True, True, True, True),
        spans,
        sink,
    )
    return grads, sink.records


def _alone(tokens, index):
    hidden, indices, weights, grad_out = (t[tokens] for t in _tokens())
    spans = SequenceSpans(len(tokens), (0,), (len(tokens),), (index,))
    return _backward(hidden, indices, weights, grad_out, spans)


def test_a_sequences_partials_and_gradients_do_not_depend_on_the_layout():
    hidden, indices, weights, grad_out = _tokens()
    spans = SequenceSpans(6, (0, 4), (3, 2), (2, 5))  # token 3: padding
    (grad_hidden, grad_weights), records = _backward(hidden, indices, weights, grad_out, spans)
    assert grad_weights.shape == weights.shape
    for tokens, index in (([0, 1, 2], 2), ([4, 5], 5)):
        (alone_hidden, alone_weights), alone = _alone(tokens, index)
        assert torch.equal(grad_hidden[tokens], alone_hidden)
        assert torch.equal(grad_weights[tokens], alone_weights)
        for role in ("moe_gate_up", "moe_down"):
            experts, values = records[(role, index)]
            assert experts.tolist() == sorted(set(indices[tokens].reshape(-1).tolist()))
            assert torch.equal(experts, alone[(role, index)][0])
            assert torch.equal(values, alone[(role, index)][1]), f"{role} of sequence {index}"


def test_negative_control_the_padding_token_would_change_the_partials():
    hidden, indices, weights, grad_out = _tokens()
    _, records = _backward(
        hidden, indices, weights, grad_out, SequenceSpans(6, (0, 4), (3, 2), (2, 5))
    )
    _, padded = _backward(
        hidden, indices, weights, grad_out, SequenceSpans(6, (0, 4), (4, 2), (2, 5))
    )
    for role in ("moe_gate_up", "moe_down"):
        assert not torch.equal(records[(role, 2)][1], padded[(role, 2)][1]), role
