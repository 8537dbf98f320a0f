"""The native silu (native/silu.py): x / (1 + exp(-x)) in fp32, the same bits at any position.

Chain: an element computed alone == the same element inside a long tensor (SIMD body vs scalar
tail) == the autograd path's result; accurate against fp64 within fp32 rounding. Negative
control: torch's own F.silu gives an element alone other bits than inside a long tensor.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from rl_engine.kernels.native.silu import silu, silu_forward


def _values(n=2000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4


def _alone_and_in_a_tensor(fn, v):
    alone = torch.cat([fn(v[i : i + 1]) for i in range(0, v.numel(), 3)])
    return alone, fn(v)[::3]


def test_an_element_alone_has_its_bits_inside_a_long_tensor():
    alone, inside = _alone_and_in_a_tensor(silu, _values())
    assert torch.equal(alone, inside)


def test_negative_control_torch_silu_depends_on_the_position():
    alone, inside = _alone_and_in_a_tensor(F.silu, _values())
    assert not torch.equal(alone, inside)


def test_the_autograd_path_has_the_bits_of_the_inference_path():
    v = _values(999, seed=1)
    with_grad = silu_forward(v.clone().requires_grad_())
    assert with_grad.requires_grad
    assert torch.equal(with_grad.detach(), silu_forward(v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_silu_is_accurate_in_the_input_dtype(dtype):
    v = _values(777, seed=2).to(dtype)
    got = silu(v)
    assert got.dtype == dtype and got.shape == v.shape
    want = F.silu(v.double())
    tol = {torch.float32: 1e-6, torch.float64: 1e-14}.get(dtype, 1e-2)  # 16-bit: one rounding
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


def test_the_registry_serves_this_op_and_its_gradient_flows():
    assert get_op("silu", "cpu", backend="native") is silu
    v = _values(10, seed=3).double().requires_grad_()
    assert torch.autograd.gradcheck(silu, (v,))


def test_a_non_float_input_is_refused_by_name():
    with pytest.raises(TypeError, match="floating"):
        silu(torch.arange(3))
