"""The cpp silu (cpp/silu.py): one vector code path for every element, forward and backward.

Chain: the op == the extension's silu kernel (fp32, bf16); an element alone == the same element
inside a long tensor, forward and gradient; the gradient is accurate against fp64 autograd;
fp64 / fp16 run native's formulation, bit for bit. Negative control: the gradient spelled with
torch.sigmoid (whose loop tail differs from its body) changes an element's bits with its
position. Position invariance of the forward on every ISA path: test_extension.py.
"""

import pytest
import torch
import torch.nn.functional as F

import rl_engine.kernels.cpp._extension as cpp_extension
from rl_engine.kernels import get_op
from rl_engine.kernels.cpp.silu import silu, silu_backward, silu_forward, silu_kernel
from rl_engine.kernels.native.silu import silu_forward as native_silu_forward


def _values(n=2000, dtype=torch.float32, seed=0):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


def _alone_and_inside(fn, v):
    return torch.cat([fn(v[i : i + 1]) for i in range(0, v.numel(), 3)]), fn(v)[::3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_is_the_kernel_and_an_element_alone_keeps_its_bits(dtype):
    v = _values(dtype=dtype)
    assert torch.equal(silu(v), cpp_extension.extension().silu(v, cpp_extension.current_isa()))
    assert torch.equal(silu(v), silu_kernel(v)) and silu(v).dtype == dtype
    alone, inside = _alone_and_inside(silu, v)
    assert torch.equal(alone, inside)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_run_natives_formulation(dtype):
    v = _values(dtype=dtype)
    assert torch.equal(silu_forward(v), native_silu_forward(v))
    assert get_op("silu", "cpu") is silu and silu(v).dtype == dtype


def test_the_gradient_keeps_an_elements_bits_and_is_accurate():
    v, grad = _values(), _values(seed=1)
    alone, inside = _alone_and_inside(lambda x: silu_backward(torch.ones_like(x), x), v)
    assert torch.equal(alone, inside)
    leaf = v.clone().requires_grad_()
    silu(leaf).backward(grad)
    assert torch.equal(leaf.grad, silu_backward(grad, v))
    v64 = v.double().requires_grad_()
    F.silu(v64).backward(grad.double())
    assert torch.allclose(leaf.grad.double(), v64.grad, rtol=1e-5, atol=1e-6)


def test_negative_control_a_gradient_through_torch_sigmoid_depends_on_the_position():
    def sigmoid_grad(x):
        s = torch.sigmoid(x)
        return s * (1 + x * (1 - s))

    alone, inside = _alone_and_inside(sigmoid_grad, _values())
    assert not torch.equal(alone, inside)
