"""silu and sigmoid (`elementwise_op`): a row's bits do not depend on its batch, nor on autograd.

Chain checked: silu(row alone) == silu(row in any batch, garbage included), on cpp and native,
within 1e-2 of fp64 F.silu; silu under no_grad == silu tracked by autograd, bit for bit. The
shared builder knows only silu and sigmoid (another name is refused, listing them), checks x
before the dtype gate, and names the op and backend when it refuses a dtype.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.native.silu import silu_forward
from tests.helpers.kernels.rowwise import FP32_ONLY, assert_row_invariant, rows

DTYPES = [torch.float32, torch.bfloat16]
MODULE = "tests.kernels.common.test_elementwise"


@pytest.mark.parametrize("backend", ["cpp", "native"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [200, 1536, 2817])
def test_silu_row_invariant_and_accurate(dtype, width, backend):
    silu = get_op("silu", "cpu", backend=backend)
    pool = rows(width, dtype)
    assert_row_invariant(silu, pool)
    torch.testing.assert_close(silu(pool).double(), F.silu(pool.double()), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_no_grad_path_has_the_same_bits_as_the_autograd_path(dtype):
    silu = get_op("silu", "cpu")
    x = rows(1537, dtype)
    with torch.no_grad():
        fast = silu(x)
    tracked = silu(x.clone().requires_grad_(True))
    assert torch.equal(fast, tracked.detach())


def test_the_builder_knows_silu_and_sigmoid_only():
    with pytest.raises(ValueError, match="unknown elementwise op 'gelu'; known: silu, sigmoid"):
        elementwise_op("gelu", silu_forward, FP32_ONLY, MODULE)


def test_the_builder_checks_x_then_gates_its_dtype():
    silu = elementwise_op("silu", silu_forward, FP32_ONLY, MODULE)
    assert silu.__name__ == "silu" and silu.__module__ == MODULE
    assert "x / (1 + exp(-x))" in silu.__doc__
    x = rows(8, torch.float32, n=2)
    assert torch.equal(silu(x), silu_forward(x))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        silu(torch.ones(2, dtype=torch.long))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        silu([1.0])
    with pytest.raises(NonInvariantDtypeError, match="op 'silu' of backend 'test'.*float16"):
        silu(x.half())
