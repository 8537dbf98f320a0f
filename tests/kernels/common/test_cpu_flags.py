"""`backward_mm`: the plain backwards' GEMM picks its compute dtype from the CPU, never the bits
of a forward. Where bf16 GEMMs have native instructions it is exactly `a @ b`; where they have
not, exactly the fp32 product rounded once (the accuracy of a native bf16 GEMM)."""

import torch

from rl_engine.kernels.common.cpu_flags import backward_mm, cpu_flags, slow_16bit_matmul


def _pair(dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(37, 300, generator=g).to(dtype), torch.randn(300, 45, generator=g).to(dtype)


def test_fp32_and_gpu_tensors_never_change_dtype():
    assert not slow_16bit_matmul(torch.float32, torch.device("cpu"))
    assert not slow_16bit_matmul(torch.bfloat16, torch.device("cuda"))
    a, b = _pair(torch.float32)
    assert torch.equal(backward_mm(a, b), a @ b)


def test_bf16_follows_the_cpu_flags():
    a, b = _pair(torch.bfloat16)
    native = any(flag in cpu_flags() for flag in ("avx512_bf16", "amx_bf16"))
    assert slow_16bit_matmul(torch.bfloat16, a.device) is (not native)
    expected = a @ b if native else (a.float() @ b.float()).to(torch.bfloat16)
    got = backward_mm(a, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    # accuracy: within one bf16 rounding of the fp64 product on every element
    exact = a.double() @ b.double()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()


def test_out_receives_the_same_bits():
    for dtype in (torch.float32, torch.bfloat16):
        a, b = _pair(dtype)
        out = torch.empty(a.shape[0], b.shape[1], dtype=dtype)
        assert backward_mm(a, b, out=out) is out and torch.equal(out, backward_mm(a, b))
