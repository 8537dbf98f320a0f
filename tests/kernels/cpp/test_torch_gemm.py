"""The torch GEMM behind the cpp GEMM ops' opted-in fp64 / fp16 (cpp/_torch_gemm.py).

Not row-invariant, so checked for what it claims only: accuracy against fp64 (one slice and
several K slices, fp64 and fp16, out dtype as asked), a call of fewer than MIN_ROWS rows gives
the rows of the same call zero-padded to MIN_ROWS (the padding is all it adds), and the slice
width: K_SLICE, or K_SLICE_16BIT_AMX for 16-bit inputs on an AMX CPU.
"""

import pytest
import torch

import rl_engine.kernels.cpp._torch_gemm as torch_gemm
from rl_engine.kernels.common.cpu_flags import cpu_flags


def _case(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, (torch.randn(n, k, generator=g) / k**0.5).to(dtype)


@pytest.mark.parametrize("k", [100, 2 * torch_gemm.K_SLICE + 37])
@pytest.mark.parametrize(
    "dtype,out_dtype,tol",
    [(torch.float64, torch.float64, 1e-12), (torch.float16, torch.float32, 2e-2)],
)
def test_the_product_is_accurate_in_the_asked_dtype(dtype, out_dtype, tol, k):
    x, w = _case(20, k, 9, dtype)
    got = torch_gemm.padded_sliced_matmul(x, w, out_dtype=out_dtype)
    assert got.shape == (20, 9) and got.dtype == out_dtype
    want = x.double() @ w.double().t()
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


def test_a_small_call_is_the_zero_padded_call():
    x, w = _case(3, 2 * torch_gemm.K_SLICE + 5, 7, torch.float64)
    padded = torch.cat([x, x.new_zeros(torch_gemm.MIN_ROWS - 3, x.shape[1])])
    want = torch_gemm.padded_sliced_matmul(padded, w, out_dtype=torch.float64)[:3]
    assert torch.equal(torch_gemm.padded_sliced_matmul(x, w, out_dtype=torch.float64), want)


def test_the_slice_width_follows_the_dtype_and_amx():
    amx = "amx_bf16" in cpu_flags()
    assert torch_gemm._k_slice_for(torch.float64) == torch_gemm.K_SLICE
    assert torch_gemm._k_slice_for(torch.float32) == torch_gemm.K_SLICE
    for dtype in (torch.bfloat16, torch.float16):
        want = torch_gemm.K_SLICE_16BIT_AMX if amx else torch_gemm.K_SLICE
        assert torch_gemm._k_slice_for(dtype) == want
