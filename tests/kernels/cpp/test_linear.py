"""The cpp linear / lm_head (cpp/linear.py): the fixed-order C++ GEMM behind the shared ops.

Chain: a row alone (M = 1) == the same row in a batch of 1 .. 300 rows, for `linear` (bias
fused) and `lm_head`, fp32 and bf16, and a strided x or weight gives the bits of its
contiguous copy; `exact_gemm` == `fixed_order_gemm` == the extension's GEMM. Negative
control: plain F.linear changes a row's bits with the batch. fp64 / fp16 are refused with
NonInvariantDtypeError unless opted in, and then run the torch GEMM (`_torch_gemm.py`).
"""

import pytest
import torch
import torch.nn.functional as F

import rl_engine.kernels.cpp._extension as cpp_extension
from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.cpp._torch_gemm import padded_sliced_matmul
from rl_engine.kernels.cpp.linear import (
    exact_gemm,
    fixed_order_gemm,
    linear,
    linear_forward,
    lm_head,
)

DTYPES = [torch.float32, torch.bfloat16]


def _case(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_has_its_bits_in_any_batch(dtype):
    x, w, bias = _case(300, 700, 70, dtype)
    for op, b in ((linear, bias), (lm_head, None)):
        full = op(x, w, b)
        for m, start in ((1, 0), (1, 299), (7, 101), (64, 200)):
            assert torch.equal(op(x[start : start + m], w, b), full[start : start + m]), (m, start)
    assert linear(x, w).dtype == dtype and lm_head(x, w).dtype == torch.float32


def test_negative_control_plain_linear_changes_a_rows_bits_with_the_batch():
    x, w, _ = _case(64, 1024, 512, torch.float32)
    full = F.linear(x, w)
    assert not all(torch.equal(F.linear(x[i : i + 1], w)[0], full[i]) for i in range(8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_operands_give_the_bits_of_contiguous_ones(dtype):
    x, w, bias = _case(20, 48, 30, dtype)
    xt, wt = x.t().contiguous().t(), w.t().contiguous().t()  # column-major views
    assert not xt.is_contiguous() and not wt.is_contiguous()
    assert torch.equal(linear_forward(xt, wt, bias, dtype), linear_forward(x, w, bias, dtype))
    assert torch.equal(fixed_order_gemm(xt, wt), fixed_order_gemm(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_gemm_is_the_extensions_fp32_gemm(dtype):
    a, b, _ = _case(9, 300, 11, dtype)
    got = exact_gemm(a, b)
    assert got.dtype == torch.float32
    ext = cpp_extension.extension()
    assert torch.equal(got, ext.gemm(a, b, cpp_extension.current_isa()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_are_refused_unless_opted_in_then_run_the_torch_gemm(dtype):
    x, w, bias = _case(5, 40, 6, dtype)
    with pytest.raises(
        NonInvariantDtypeError, match=f"'linear' of backend 'cpp'.*{str(dtype)[6:]}"
    ):
        linear(x, w, bias)
    opted_in = get_op("linear", "cpu", allow_non_invariant=True)
    want = padded_sliced_matmul(x, w, out_dtype=dtype) + bias
    assert torch.equal(opted_in(x, w, bias), want)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert torch.equal(fixed_order_gemm(x, w), padded_sliced_matmul(x, w, out_dtype=acc))


def test_a_tensor_off_cpu_is_named():
    x, w, _ = _case(2, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="x is on meta: the cpp backend runs on cpu"):
        linear(x.to("meta"), w.to("meta"))
