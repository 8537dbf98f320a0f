"""The cpp backend's package (rl_engine/kernels/cpp/__init__.py): its ops and its layout facts.

Checks: every op name the registry knows resolves, for cpu, to this package's function; the
row-wise ops that are already invariant in plain torch (embedding, rms_norm, sigmoid,
log_softmax) are the native ones, the others its own; LAYOUT says the GEMM never slices K,
the KV cache is read in 16-position blocks in the compute dtype, and weights are packed by
packed_linear.py.
"""

import torch

import rl_engine.kernels.cpp as cpp
import rl_engine.kernels.native as native
from rl_engine.kernels import backend_layout, get_op, list_ops
from rl_engine.kernels.cpp import packed_linear

NATIVE_OPS = ("embedding", "rms_norm", "sigmoid", "log_softmax")


def test_every_op_resolves_to_this_package_on_cpu():
    assert sorted(cpp.__all__) == sorted(["LAYOUT", *list_ops()])
    for name in list_ops():
        assert get_op(name, "cpu") is getattr(cpp, name), name
        assert get_op(name, "cpu", backend="cpp") is getattr(cpp, name), name


def test_plain_torch_row_wise_ops_are_the_native_ones():
    for name in NATIVE_OPS:
        assert getattr(cpp, name) is getattr(native, name), name
    own = set(list_ops()) - set(NATIVE_OPS)
    for name in own:
        assert getattr(cpp, name).__module__.startswith("rl_engine.kernels.cpp."), name


def test_layout_facts():
    layout = backend_layout("cpu")
    assert layout is cpp.LAYOUT and layout.kv_block == cpp.KEY_BLOCK == 16
    assert layout.kv_in_compute_dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        assert layout.k_slice_for(dtype) == cpp.unsliced(dtype) == 0
    packing = layout.weight_packing
    assert packing.packs is packed_linear.packs and packing.pack is packed_linear.pack_weight
    assert packing.project is packed_linear.packed_projection
