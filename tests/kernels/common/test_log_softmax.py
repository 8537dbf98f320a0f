"""log_softmax: a row's logprobs do not depend on its batch; fp32 out, within a width-scaled
tolerance of fp64.

Chain checked: log_softmax(row alone, T) == log_softmax(row in any batch, garbage included, T)
for T in {1, 0.7}. The shared builder (`log_softmax_op`) checks the logits and the temperature
(finite, > 0) before the dtype gate and refuses 0-dim logits, naming them.
"""

import pytest
import torch

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.log_softmax import log_softmax_op
from rl_engine.kernels.native.log_softmax import log_softmax_forward
from tests.helpers.kernels.rowwise import FP32_ONLY, assert_row_invariant, rows


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("width", [1000, 49152])
def test_log_softmax_row_invariant(width, temperature):
    log_softmax = get_op("log_softmax", "cpu")
    pool = rows(width, torch.float32, n=64)
    assert_row_invariant(lambda x: log_softmax(x, temperature), pool)
    ref = torch.log_softmax(pool.double() / temperature, -1)
    # Accuracy, not invariance: the fp32 sum of `width` exponentials carries a rounding error that
    # grows with the row and with the SIMD width of torch's kernel. Measured vs fp64 at 49152 and
    # T = 0.7: max |err| 2.0e-5 on an AVX2-only EPYC (8 lanes), under 1e-5 on AVX-512 CPUs.
    atol = 1e-5 * max(1.0, width / 1000) ** 0.5
    torch.testing.assert_close(log_softmax(pool, temperature).double(), ref, atol=atol, rtol=1e-6)
    assert log_softmax(pool.bfloat16(), temperature).dtype == torch.float32


def test_the_builder_checks_logits_and_temperature_before_the_dtype_gate():
    log_softmax = log_softmax_op(
        log_softmax_forward, FP32_ONLY, "tests.kernels.common.test_log_softmax"
    )
    logits = rows(16, torch.float32, n=2)
    assert torch.equal(log_softmax(logits, 0.7), log_softmax_forward(logits, 0.7))
    half = logits.bfloat16()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            log_softmax(half, bad)
    with pytest.raises(ValueError, match="logits must have at least one dim"):
        log_softmax(torch.tensor(1.0, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        log_softmax(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(NonInvariantDtypeError, match="op 'log_softmax' of backend 'test'"):
        log_softmax(half)
