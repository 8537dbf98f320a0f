"""What the native elementwise ops' tests share (native/test_silu.py, native/test_sigmoid.py):
their inputs, the alone-versus-inside comparison and the accuracy and autograd checks."""

from __future__ import annotations

import torch

# 16-bit dtypes: one rounding of the fp64 result
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-14}
ACCURACY_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def values(n: int = 2000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4


def alone_and_in_a_tensor(fn, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every third element computed alone, and the same elements inside the whole tensor."""
    alone = torch.cat([fn(v[i : i + 1]) for i in range(0, v.numel(), 3)])
    return alone, fn(v)[::3]


def assert_autograd_bits_equal_inference_bits(forward) -> None:
    v = values(999, seed=1)
    with_grad = forward(v.clone().requires_grad_())
    assert with_grad.requires_grad
    assert torch.equal(with_grad.detach(), forward(v))


def assert_accurate(op, reference, dtype: torch.dtype) -> None:
    """`op` in `dtype` against `reference` in fp64, within one rounding of `dtype`."""
    v = values(777, seed=2).to(dtype)
    got = op(v)
    assert got.dtype == dtype and got.shape == v.shape
    want = reference(v.double())
    tol = TOLERANCE.get(dtype, 1e-2)
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


def assert_gradcheck(op) -> None:
    v = values(10, seed=3).double().requires_grad_()
    assert torch.autograd.gradcheck(op, (v,))
