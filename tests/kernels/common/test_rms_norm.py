"""rms_norm: a row's bits do not depend on its batch, and the op has HF LlamaRMSNorm's semantics.

Chain checked: rms_norm(row alone) == rms_norm(row in any batch, next to any rows, garbage
included), within fp32/bf16 tolerance of LlamaRMSNorm. The shared builder (`rms_norm_op`)
checks its inputs before the dtype gate (a bad input gets its own error, naming the tensor),
gates the dtype before any compute, and returns x * weight for an empty input without
calling the backend's forward.
"""

import pytest
import torch

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.rms_norm import rms_norm_op
from rl_engine.kernels.native.rms_norm import rms_norm_forward
from tests.helpers.kernels.rowwise import FP32_ONLY, assert_row_invariant, rows

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 576, 4096])
def test_rms_norm_row_invariant_and_matches_hf(dtype, width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rms_norm = get_op("rms_norm", "cpu")
    hf = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(width) + 0.5)
    pool = rows(width, dtype)
    assert_row_invariant(lambda x: rms_norm(x, hf.weight, 1e-5), pool)
    ref = hf(pool)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(rms_norm(pool, hf.weight, 1e-5), ref, atol=tol, rtol=tol)


def _fp32_only_rms_norm():
    return rms_norm_op(rms_norm_forward, FP32_ONLY, "tests.kernels.common.test_rms_norm")


def test_the_builder_checks_inputs_before_the_dtype_gate():
    rms_norm = _fp32_only_rms_norm()
    x, w = rows(8, torch.bfloat16, n=3), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x has last dim 8 but the norm weight's size is 7"):
        rms_norm(x, w[:7])
    with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
        rms_norm(x, torch.ones(8, dtype=torch.long))
    with pytest.raises(NonInvariantDtypeError, match="op 'rms_norm' of backend 'test'.*bfloat16"):
        rms_norm(x, w)


def test_the_builder_serves_the_forward_and_the_empty_input():
    rms_norm = _fp32_only_rms_norm()
    x, w = rows(8, torch.float32, n=3), torch.rand(8) + 0.5
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_forward(x, w, 1e-5))
    empty = rms_norm(torch.zeros(0, 8), w)
    assert empty.shape == (0, 8)
    assert rms_norm(torch.zeros(2, 0), torch.zeros(0)).shape == (2, 0)
