"""The native linear / lm_head (native/linear.py): the tile GEMM plus bias, and its exact GEMM.

Checks: `linear_forward` is `tiled_matmul` then `+ bias` in the out dtype, accurate against
fp64; the ops keep leading dims, `linear` returns x.dtype and `lm_head` fp32; `exact_gemm`
runs bf16 operands through the tile scheme in fp32 (== the scheme on the exactly converted
operands; negative control: the scheme in bf16 rounds each slice and gives other bits). The
ops and `exact_gemm` ask the platform probe first: where it refuses a dtype they raise
PlatformInvarianceError (checked) and their bit-level checks skip with its reason. Row
invariance through these ops: test_tiles.py.
"""

import pytest
import torch

import rl_engine.kernels.native._tiles as tiles
from rl_engine.kernels import PlatformInvarianceError, get_op
from rl_engine.kernels.native.linear import exact_gemm, linear, linear_forward, lm_head
from rl_engine.kernels.native.platform_probe import platform_refusal
from tests.helpers.invariance import skip_if_refused


def _case(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_linear_forward_is_the_tile_gemm_plus_bias_and_accurate(dtype, tol):
    x, w, bias = _case(70, 600, 33, dtype)
    got = linear_forward(x, w, bias, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, tiles.tiled_matmul(x, w, out_dtype=dtype) + bias)
    want = x.double() @ w.double().t() + bias.double()
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_keep_leading_dims_and_their_out_dtypes(dtype):
    skip_if_refused("native", dtype)
    x, w, bias = _case(6, 40, 9, dtype)
    x3 = x.view(2, 3, 40)
    out = linear(x3, w, bias)
    assert out.shape == (2, 3, 9) and out.dtype == dtype
    assert torch.equal(out.view(6, 9), linear_forward(x, w, bias, dtype))
    head = lm_head(x3, w)
    assert head.dtype == torch.float32
    assert torch.equal(head.view(6, 9), linear_forward(x, w, None, torch.float32))
    assert get_op("linear", "cpu", backend="native") is linear


def test_exact_gemm_converts_bf16_operands_exactly_to_fp32():
    skip_if_refused("native", torch.float32)
    a, b, _ = _case(70, 700, 20, torch.bfloat16)
    got = exact_gemm(a, b)
    assert got.dtype == torch.float32
    assert torch.equal(got, tiles.tiled_matmul(a.float(), b.float(), out_dtype=torch.float32))
    rounded = tiles.tiled_matmul(a, b, out_dtype=torch.float32)  # each slice rounded to bf16
    assert not torch.equal(got, rounded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_refused_dtype_raises_with_the_probes_reason(dtype):
    """On a CPU whose probe accepts the dtype, the op runs; where it refuses, the error says why."""
    x, w, _ = _case(3, 16, 4, dtype)
    reason = platform_refusal(dtype, "cpu")
    if reason is None:
        assert linear(x, w).shape == (3, 4)
        return
    with pytest.raises(PlatformInvarianceError) as err:
        linear(x, w)
    assert str(err.value).startswith(reason) and "allow_non_invariant=True" in str(err.value)
    opted_in = get_op("linear", "cpu", backend="native", allow_non_invariant=True)
    assert torch.equal(opted_in(x, w), linear_forward(x, w, None, dtype))


def test_bad_operands_are_named():
    x, w, bias = _case(3, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="bias must have shape \\(4,\\)"):
        linear(x, w, bias[:3])
    with pytest.raises(TypeError, match="x is torch.bfloat16 but weight is torch.float32"):
        linear(x.bfloat16(), w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        lm_head(x, w[None])
