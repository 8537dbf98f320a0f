"""The native log_softmax (native/log_softmax.py): THE logprob, log_softmax(logits.float() / T).

Chain: log_softmax(logits, T) == torch.log_softmax(logits.float() / T) (the definition the
rollout engine and the trainer share), in fp32 for 16-bit and fp32 logits, fp64 for fp64; a
row alone == the same row in a batch. Negative control: scaling by 1 / T instead of dividing
by T gives other bits, so the definition's `/` is what the equalities pin.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.native.log_softmax import log_softmax, log_softmax_forward


def _logits(rows=6, vocab=1001, dtype=torch.float32, seed=0):
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_log_softmax_is_the_stated_definition(dtype, temperature):
    logits = _logits(dtype=dtype)
    got = log_softmax(logits, temperature)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.dtype == acc
    assert torch.equal(got, torch.log_softmax(logits.to(acc) / temperature, dim=-1))


def test_a_row_alone_has_its_bits_in_a_batch():
    logits = _logits(rows=9)
    batch = log_softmax(logits, 0.7)
    for row in range(9):
        assert torch.equal(log_softmax(logits[row], 0.7), batch[row]), row


def test_negative_control_multiplying_by_the_inverse_temperature_changes_bits():
    logits = _logits(rows=4)
    scaled = torch.log_softmax(logits * (1 / 0.7), dim=-1)
    assert not torch.equal(scaled, log_softmax_forward(logits, 0.7))


def test_the_registry_serves_this_op():
    assert get_op("log_softmax", "cpu", backend="native") is log_softmax


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_temperature_is_named(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        log_softmax(_logits(), temperature)


def test_bad_logits_are_named():
    with pytest.raises(ValueError, match="logits must have at least one dim"):
        log_softmax(torch.tensor(1.0))
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        log_softmax(torch.arange(4))
