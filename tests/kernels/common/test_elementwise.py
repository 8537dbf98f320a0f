"""silu and sigmoid (`elementwise_op`): a row's bits do not depend on its batch, nor on autograd.

Chain checked: silu(row alone) == silu(row in any batch, garbage included), on cpp and native,
within 1e-2 of fp64 F.silu; silu under no_grad == silu tracked by autograd, bit for bit;
sigmoid of each element alone, or in chunks of 13, == sigmoid of the whole vector (negative
control: torch.sigmoid is not position-invariant in fp32 on this CPU). The
shared builder knows only silu and sigmoid (another name is refused, listing them), checks x
before the dtype gate, and names the op and backend when it refuses a dtype.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.elementwise import elementwise_op
from rl_engine.kernels.native.silu import silu_forward
from tests.helpers.kernels.moe import randn
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


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sigmoid_is_position_invariant_and_torch_sigmoid_is_not(dtype):
    sigmoid = get_op("sigmoid", "cpu")
    x = randn(4099, dtype=dtype, seed=23, scale=4.0)
    full = sigmoid(x)
    alone = torch.cat([sigmoid(x[i : i + 1]) for i in range(300)])
    assert torch.equal(full[:300], alone)
    shifted = torch.cat([sigmoid(x[i : i + 13]) for i in range(0, 299, 13)])
    assert torch.equal(full[: shifted.numel()], shifted)
    torch.testing.assert_close(full.double(), torch.sigmoid(x.double()), atol=1e-2, rtol=1e-2)
    if dtype == torch.float32:  # the negative control (bf16 rounds the difference away)
        plain = torch.cat([torch.sigmoid(x[i : i + 1]) for i in range(2000)])
        assert not torch.equal(torch.sigmoid(x)[:2000], plain)
