"""What the cpp backend serves (cpp/_serving.py): cpu tensors only; its GEMM ops fp32 / bf16 only.

Checks: `check_device` names the tensor, its device and how to get the op for that device;
the kernels' guard (`KERNELS`: attention, silu) takes every floating dtype; the GEMM ops'
guard (`GEMM`) refuses fp64 / fp16 with NonInvariantDtypeError naming the op, the backend,
the dtype and the torch GEMM that would run, and its opt-in twin checks the device only.
Through the real ops: `linear` refuses fp16, `silu` serves it.
"""

import pytest
import torch

import rl_engine.kernels.cpp._serving as serving
from rl_engine.kernels import NonInvariantDtypeError, get_op


def test_check_device_names_the_tensor_and_the_device():
    serving.check_device("x", torch.zeros(1))
    with pytest.raises(ValueError, match=r"x is on meta: the cpp backend runs on cpu.*'meta'"):
        serving.check_device("x", torch.zeros(1, device="meta"))


def test_kernel_ops_serve_every_floating_dtype_on_cpu():
    guard = serving.KERNELS.guard("silu", allow_non_invariant=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        guard("x", torch.zeros(1, dtype=dtype))
    with pytest.raises(ValueError, match="x is on meta"):
        guard("x", torch.zeros(1, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_gemm_ops_refuse_other_dtypes_by_name_unless_opted_in(dtype):
    strict = serving.GEMM.guard("linear", allow_non_invariant=False)
    for ok in serving.KERNEL_DTYPES:
        strict("x", torch.zeros(1, dtype=ok))
    with pytest.raises(NonInvariantDtypeError) as err:
        strict("x", torch.zeros(1, dtype=dtype))
    message = str(err.value)
    name = str(dtype).removeprefix("torch.")
    assert f"op 'linear' of backend 'cpp' is not row-invariant for {name}" in message, message
    assert "cpp/_torch_gemm.py" in message and "allow_non_invariant=True" in message, message
    opted_in = serving.GEMM.guard("linear", allow_non_invariant=True)
    opted_in("x", torch.zeros(1, dtype=dtype))
    with pytest.raises(ValueError, match="x is on meta"):
        opted_in("x", torch.zeros(1, dtype=dtype, device="meta"))


def test_the_ops_apply_their_serving():
    x = torch.randn(2, 8, dtype=torch.float16)
    with pytest.raises(NonInvariantDtypeError, match="float16"):
        get_op("linear", "cpu")(x, torch.randn(3, 8, dtype=torch.float16))
    assert get_op("silu", "cpu")(x).dtype == torch.float16
