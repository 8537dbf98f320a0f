"""The cpp backend's packed weights (cpp/packed_linear.py): layout only, the bits of the ops.

`packed_projection(x, pack_weight(w), bias)` == `linear(x, w, bias)` and, with an fp32 out,
== `lm_head(x, w, bias)`, torch.equal, on every instruction-set path this CPU runs, at 1 and
2 threads, for decode and prefill row counts, N not a multiple of the 64-column panel, odd K
and K over several K blocks. Negative control: a packed copy of the weight before a change
no longer matches the op on the changed weight (a packed weight is a copy), and repacking it
into its own buffer does.
"""

import pytest
import torch

import rl_engine.kernels.cpp._extension as cpp_extension
from rl_engine.kernels import backend_layout, get_op
from rl_engine.kernels.cpp.packed_linear import PackedWeight

ISAS = list(cpp_extension.ISA_PATHS)
SHAPES = [(1, 1), (64, 576), (192, 576), (130, 33), (577, 1537), (49, 3)]  # (N, K)
ROWS = (1, 2, 3, 8, 13, 32, 65, 500)
PACKING = backend_layout("cpu", "cpp").weight_packing


@pytest.fixture
def isa_path(request, monkeypatch):
    if request.param not in cpp_extension.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    monkeypatch.setenv(cpp_extension.ISA_ENV, request.param)
    return request.param


def _case(n, k, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("isa_path", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_projection_has_the_bits_of_linear_and_lm_head(isa_path, dtype):
    linear, lm_head = get_op("linear", "cpu"), get_op("lm_head", "cpu")
    before = torch.get_num_threads()
    try:
        for n, k in SHAPES:
            for m in ROWS:
                x, w, bias = _case(n, k, m, dtype)
                packed = PACKING.pack(w)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for b in (None, bias):
                        got = PACKING.project(x, packed, b)
                        assert torch.equal(got, linear(x, w, b)), (n, k, m, threads, b is None)
                        head = PACKING.project(x, packed, b, torch.float32)
                        assert torch.equal(head, lm_head(x, w, b)), (n, k, m, threads, b is None)
    finally:
        torch.set_num_threads(before)


def test_packed_projection_keeps_leading_dims():
    linear = get_op("linear", "cpu")
    x, w, bias = _case(70, 40, 24, torch.bfloat16)
    x = x.view(2, 3, 4, 40)
    assert torch.equal(PACKING.project(x, PACKING.pack(w), bias), linear(x, w, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_packed_weight_is_a_copy_and_repacking_into_it_sees_the_change(dtype):
    linear = get_op("linear", "cpu")
    x, w, _ = _case(100, 300, 8, dtype)
    packed = PACKING.pack(w)
    buffer = packed.data
    with torch.no_grad():
        w.mul_(1.5)
    # negative control: the old panels no longer give the op on the changed weight
    assert not torch.equal(PACKING.project(x, packed, None), linear(x, w))
    repacked = PACKING.pack(w, into=packed)
    assert repacked.data.data_ptr() == buffer.data_ptr()  # in place: nothing allocated
    assert torch.equal(PACKING.project(x, repacked, None), linear(x, w))
    assert torch.equal(repacked.data, PACKING.pack(w).data)  # the panels are a function of w


def test_a_packed_weight_records_its_shape_dtype_and_size():
    _, w, _ = _case(70, 40, 3, torch.bfloat16)
    packed = PACKING.pack(w)
    assert isinstance(packed, PackedWeight) and packed.data.dim() == 1
    assert (packed.out_features, packed.in_features, packed.dtype) == (70, 40, torch.bfloat16)
    assert packed.nbytes == packed.data.numel() * 2 >= w.numel() * 2


def test_packing_refuses_what_it_cannot_serve():
    x, w, _ = _case(10, 20, 3, torch.float32)
    packed = PACKING.pack(w)
    assert not PACKING.packs(w.double()) and not PACKING.packs(w.half())
    with pytest.raises(ValueError, match="float32 / bfloat16"):
        PACKING.pack(w.double())
    with pytest.raises(ValueError, match="cannot repack"):
        PACKING.pack(w[:5], into=packed)
    with pytest.raises(ValueError, match="packed weight is torch.float32"):
        PACKING.project(x.bfloat16(), packed)
    with pytest.raises(ValueError, match="K=19"):
        PACKING.project(x[:, :19], packed)
    with pytest.raises(RuntimeError, match="forward only"):
        PACKING.project(x.requires_grad_(), packed)
    with pytest.raises(RuntimeError, match="does not hold"):
        cpp_extension.extension().gemm_packed(x, packed.data, 100, cpp_extension.current_isa())
