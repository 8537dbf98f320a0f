"""embedding: each token's output is its weight row, ids are range-checked by name, and the
gradient is exactly autograd's.

Chain checked: embedding(ids, w) == w[ids]; its backward == the hand sum of the upstream rows
per id, twice the same; `add_embedding_grad_(g, ids, dy)` == g + autograd's dense embedding
gradient, bit for bit (padding_idx and a -0.0 in g included). Negative control: summing one
id's rows in reverse token order gives other bits, so the order `add_embedding_grad_` keeps
is what the equality checks.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.embedding import add_embedding_grad_, embedding_op
from rl_engine.kernels.native.embedding import embedding_forward
from tests.helpers.kernels.rowwise import FP32_ONLY, rows


def test_embedding_rows_are_weight_rows_and_ids_are_checked():
    embedding = get_op("embedding", "cpu")
    w = rows(32, torch.float32, n=1000)
    ids = torch.tensor([[0, 999, 5], [7, 7, 3]])
    assert torch.equal(embedding(ids, w), w[ids])
    with pytest.raises(
        ValueError,
        match=r"token ids out of range: min 0, max 1000, but the vocabulary size is 1000",
    ):
        embedding(torch.tensor([0, 1000]), w)
    with pytest.raises(ValueError, match="min -1"):
        embedding(torch.tensor([-1, 3]), w)
    with pytest.raises(TypeError, match="integer"):
        embedding(torch.tensor([0.0]), w)
    assert embedding(torch.zeros(0, dtype=torch.long), w).shape == (0, 32)


def test_embedding_backward_matches_reference_and_is_deterministic():
    embedding = get_op("embedding", "cpu")
    ids = torch.tensor([[3, 7, 3], [0, 7, 9]])
    grads = []
    for _ in range(2):
        w = rows(16, torch.float32, n=10).requires_grad_(True)
        (embedding(ids, w) * torch.arange(96.0).reshape(2, 3, 16)).sum().backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])
    expected = torch.zeros(10, 16)
    weights = torch.arange(96.0).reshape(2, 3, 16)
    for (b, t), token in zip(
        [(b, t) for b in range(2) for t in range(3)], ids.reshape(-1).tolist()
    ):
        expected[token] += weights[b, t]
    assert torch.equal(grads[0], expected)


def _tied_gradient_case(padding_idx):
    g = torch.Generator().manual_seed(3)
    vocab, hidden = 40, 8
    ids = torch.randint(0, 6, (300,), generator=g).reshape(3, 100)  # ids 0..5, many repeats
    ids[0, :4] = 30  # one more id, and the padding row when padding_idx is 30
    grad_out = torch.randn(3, 100, hidden, generator=g)
    grad_weight = torch.randn(vocab, hidden, generator=g)
    grad_weight[20, 0] = -0.0  # a row no id touches: + 0 makes it +0.0, as autograd's sum does
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    (dense,) = torch.autograd.grad(F.embedding(ids, weight, padding_idx), weight, grad_out)
    return ids, grad_out, grad_weight, grad_weight + dense


@pytest.mark.parametrize("padding_idx", [None, 30])
def test_add_embedding_grad_equals_autograds_sum(padding_idx):
    ids, grad_out, grad_weight, expected = _tied_gradient_case(padding_idx)
    got = add_embedding_grad_(grad_weight.clone(), ids, grad_out, padding_idx)
    assert torch.equal(got, expected)
    assert torch.equal(got[20, :1], torch.zeros(1)) and not got[20, 0].signbit()


def test_negative_control_another_summation_order_gives_other_bits():
    ids, grad_out, grad_weight, expected = _tied_gradient_case(None)
    flat_ids, flat_grad = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
    reversed_sum = torch.zeros_like(grad_weight)
    for token in reversed(range(flat_ids.numel())):
        reversed_sum[flat_ids[token]] += flat_grad[token]
    assert not torch.equal(grad_weight + reversed_sum, expected)


def test_the_builder_gates_the_weights_dtype_after_checking_the_ids():
    embedding = embedding_op(embedding_forward, FP32_ONLY, "tests.kernels.common.test_embedding")
    w = rows(4, torch.float32, n=10)
    ids = torch.tensor([1, 9, 1])
    assert torch.equal(embedding(ids, w), w[ids])
    with pytest.raises(ValueError, match="token ids out of range: min 1, max 10"):
        embedding(torch.tensor([1, 10]), w.bfloat16())
    with pytest.raises(ValueError, match="embedding weight must be 2-D"):
        embedding(ids, w[0].bfloat16())
    with pytest.raises(NonInvariantDtypeError, match="op 'embedding' of backend 'test'"):
        embedding(ids, w.bfloat16())
