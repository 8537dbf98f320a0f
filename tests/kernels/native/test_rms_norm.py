"""The native rms_norm (native/rms_norm.py): Hugging Face's RMSNorm, a row's bits its own.

Chain: rms_norm(x) == weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype) (HF LlamaRMSNorm,
spelled out) for a batch of rows; a row alone (a one-row input, whose mean torch would split
across threads) == the same row in a batch, at 2 threads. Negative control: the plain
one-row mean splits a long row across threads and gives other bits for some length.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.native.rms_norm import rms_norm, rms_norm_forward

LONG_ROWS = (65536, 131072)  # long enough that torch splits a one-row mean across threads


def _hf_rms_norm(x, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_rows_is_hugging_faces_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=g).to(dtype)
    weight = torch.randn(48, generator=g).to(dtype)
    got = rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and torch.equal(got, _hf_rms_norm(x, weight, 1e-5))


def test_a_row_alone_has_its_bits_in_a_batch(two_threads):
    g = torch.Generator().manual_seed(1)
    for h in LONG_ROWS:
        x, weight = torch.randn(3, h, generator=g), torch.randn(h, generator=g)
        batch = rms_norm_forward(x, weight, 1e-6)
        for row in range(3):
            alone = rms_norm_forward(x[row : row + 1], weight, 1e-6)
            assert torch.equal(alone[0], batch[row]), (h, row)


def test_negative_control_a_plain_one_row_mean_splits_across_threads(two_threads):
    g = torch.Generator().manual_seed(1)
    differ = []
    for h in LONG_ROWS * 3:  # whether the split order changes a sum's bits depends on the data
        x = torch.randn(2, h, generator=g)
        differ.append(not torch.equal(x[:1].pow(2).mean(-1), x.pow(2).mean(-1)[:1]))
    assert any(differ), "the one-row mean kept its bits at every length: the test above is void"


def test_empty_rows_and_the_registry():
    weight = torch.ones(0)
    assert rms_norm(torch.zeros(2, 0), weight).shape == (2, 0)
    assert get_op("rms_norm", "cpu", backend="native") is rms_norm


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="x.*norm weight"):
        rms_norm(torch.zeros(2, 4), torch.ones(5))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        rms_norm(torch.zeros(2, 4, dtype=torch.long), torch.ones(4))
