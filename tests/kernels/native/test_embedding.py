"""The native embedding (native/embedding.py): a gather, so each token's row is its weight row.

Chain: embedding(ids, weight)[t] == weight[ids[t]] bit for bit, in every floating dtype and
for any ids shape; the padding row gets no gradient. Negative control: the row of a
neighbouring id has other bits (the check tells rows apart). Bad ids are named with their
range.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.native.embedding import embedding


def _weight(dtype=torch.float32, vocab=50, hidden=12):
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_token_gets_its_weight_row_bit_for_bit(dtype):
    weight = _weight(dtype)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    got = embedding(ids, weight)
    assert got.shape == (2, 3, 12) and got.dtype == dtype
    for pos, token in enumerate(ids.reshape(-1).tolist()):
        assert torch.equal(got.reshape(-1, 12)[pos], weight[token]), (pos, token)


def test_negative_control_a_neighbouring_id_gets_other_bits():
    """The row check discriminates: every id's row differs from the next id's row."""
    weight = _weight(torch.bfloat16)
    got = embedding(torch.arange(50), weight)
    assert all(not torch.equal(got[i], weight[i + 1]) for i in range(49))


def test_the_padding_row_gets_no_gradient():
    weight = _weight().requires_grad_()
    embedding(torch.tensor([1, 2, 2]), weight, padding_idx=2).sum().backward()
    assert not weight.grad[2].any() and weight.grad[1].eq(1).all()
    assert get_op("embedding", "cpu", backend="native") is embedding


def test_bad_ids_are_named_with_their_range():
    with pytest.raises(ValueError, match=r"token ids out of range: min -1, max 50.*\[0, 49\]"):
        embedding(torch.tensor([-1, 50]), _weight())
    with pytest.raises(TypeError, match="token ids must be an integer tensor"):
        embedding(torch.tensor([1.0]), _weight())
