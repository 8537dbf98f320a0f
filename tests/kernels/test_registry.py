"""The registry: the device type alone picks the backend, explicit requests never fall back.

cpu -> cpp (raises if it cannot load, unless backend="native" is asked for);
cuda -> triton (raises if triton cannot load, unless backend="native" is asked
for); cpu + backend="triton" only under Triton's interpreter. Layout facts come from the backend through `backend_layout`.
"""

import importlib
import sys

import pytest
import torch

from rl_engine.kernels import (
    OP_NAMES,
    backend_layout,
    cpp,
    get_op,
    interpreter_enabled,
    list_backends,
    list_ops,
    resolve_backend,
)
from rl_engine.kernels import registry as registry_module
from rl_engine.kernels.native import attention, linear_logp


def test_every_op_resolves_on_cpu_to_cpp_and_native_stays_reachable():
    assert set(list_ops()) >= {
        "embedding",
        "linear",
        "lm_head",
        "rms_norm",
        "log_softmax",
        "attention",
        "linear_logp",
    }
    assert list_backends("cpu") == ["cpp", "native", "triton"]
    for name in OP_NAMES:
        assert get_op(name, "cpu") is getattr(cpp, name), name
        native_fn = get_op(name, "cpu", backend="native")
        assert native_fn.__module__.startswith("rl_engine.kernels.native"), name
    assert get_op("linear_logp", torch.device("cpu"), backend="native") is linear_logp
    assert get_op("attention", "cpu", backend="native") is attention
    assert resolve_backend("cpu") == "cpp"


@pytest.mark.triton
def test_cuda_resolves_to_triton_when_it_loads_and_native_only_when_asked():
    assert list_backends("cuda:1") == ["triton", "native"]
    assert resolve_backend("cuda:0") == "triton"
    for name in OP_NAMES:
        assert get_op(name, "cuda").__module__.startswith("rl_engine.kernels.triton"), name
        assert get_op(name, "cuda", backend="native").__module__.startswith(
            "rl_engine.kernels.native"
        ), name
    assert get_op("linear_logp", "cuda", backend="native") is linear_logp
    with pytest.raises(TypeError, match="device must be a str or torch.device"):
        get_op("linear", None)


@pytest.mark.triton
@pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (no GPU)")
def test_cpu_serves_triton_only_under_the_interpreter(monkeypatch):
    # tests/conftest.py sets TRITON_INTERPRET=1 before the backend is imported
    fn = get_op("silu", "cpu", backend="triton")
    assert fn.__module__ == "rl_engine.kernels.triton.silu"
    assert torch.equal(fn(torch.zeros(3)), torch.zeros(3))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on cpu only under Triton's interpreter"):
        get_op("silu", "cpu", backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("cpu", "triton")
    assert get_op("silu", "cpu").__module__.startswith("rl_engine.kernels.cpp")


@pytest.fixture
def triton_missing(monkeypatch):
    """Make `import triton` fail, as on a machine without triton (restored afterwards)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in [m for m in sys.modules if m.startswith("rl_engine.kernels.triton")]:
        monkeypatch.delitem(sys.modules, name)
    registry_module._load_backend.cache_clear()
    yield
    registry_module._load_backend.cache_clear()


@pytest.mark.triton
def test_nothing_falls_back_when_triton_cannot_load(triton_missing):
    with pytest.raises(
        RuntimeError, match="'triton' is the backend of cuda but cannot load"
    ) as err:
        get_op("linear", "cuda")
    assert "backend='native'" in str(err.value)
    with pytest.raises(
        RuntimeError, match="'triton' was requested but cannot load: ModuleNotFoundError"
    ):
        get_op("linear", "cuda", backend="triton")
    with pytest.raises(RuntimeError, match="cannot load"):
        get_op("linear", "cpu", backend="triton")
    with pytest.raises(RuntimeError, match="cannot load"):
        backend_layout("cuda")
    assert (
        get_op("linear", "cuda", backend="native").__module__ == "rl_engine.kernels.native.linear"
    )
    assert get_op("linear", "cpu").__module__ == "rl_engine.kernels.cpp.linear"


def test_unknown_op_lists_the_ops():
    with pytest.raises(KeyError, match="available ops: embedding, linear"):
        get_op("matmul", "cpu")


def test_unknown_backend_lists_the_backends():
    with pytest.raises(
        ValueError, match="unknown backend 'cudnn'; known backends: cpp, native, triton"
    ):
        get_op("linear", "cuda", backend="cudnn")


def test_unsupported_device_lists_the_devices():
    with pytest.raises(ValueError, match="unsupported device 'mps'; supported devices: cpu, cuda"):
        get_op("linear", "mps")
    with pytest.raises(ValueError, match="invalid device"):
        get_op("linear", "not-a-device")


@pytest.fixture
def cpp_missing(monkeypatch):
    """Make the cpp backend fail to import, as on a machine where it did not build."""
    monkeypatch.setitem(sys.modules, "rl_engine.kernels.cpp", None)
    registry_module._load_backend.cache_clear()
    yield
    registry_module._load_backend.cache_clear()


def test_nothing_falls_back_when_cpp_cannot_load(cpp_missing):
    with pytest.raises(RuntimeError, match="'cpp' is the backend of cpu but cannot load") as err:
        get_op("linear", "cpu")
    assert "backend='native'" in str(err.value)
    assert get_op("linear", "cpu", backend="native").__module__ == "rl_engine.kernels.native.linear"


def test_layout_facts_come_from_the_backend():
    native = backend_layout("cpu", "native")
    assert native.kv_block == 128 and native.kv_in_compute_dtype
    assert (native.k_slice_for(torch.float32), native.k_slice_for(torch.bfloat16)) == (512, 256)
    cpp_layout = backend_layout("cpu")
    assert cpp_layout.kv_block == cpp.KEY_BLOCK and cpp_layout.kv_in_compute_dtype
    assert cpp_layout.k_slice_for(torch.bfloat16) == 0  # one fixed-order reduction over all of K


@pytest.mark.triton
def test_triton_layout_facts_are_the_kernels_constants():
    attention = importlib.import_module("rl_engine.kernels.triton.attention")
    matmul = importlib.import_module("rl_engine.kernels.triton._matmul")
    layout = backend_layout("cuda")
    assert layout.kv_block == attention.BLOCK_N and not layout.kv_in_compute_dtype
    assert layout.k_slice_for(torch.bfloat16) == matmul.BLOCK_K
    expected = (32, 64) if interpreter_enabled() else (64, 64)  # interpreter / GPU tiles
    assert (layout.kv_block, layout.k_slice_for(torch.float32)) == expected


def test_weight_packing_is_validated():
    """A backend's layout names its weight packing (cpp) or None; anything else is refused."""
    from rl_engine.kernels import BackendLayout, WeightPacking, backend_layout

    assert isinstance(backend_layout("cpu", "cpp").weight_packing, WeightPacking)
    assert backend_layout("cpu", "native").weight_packing is None
    with pytest.raises(TypeError, match="weight_packing must be a WeightPacking"):
        BackendLayout(kv_block=1, kv_in_compute_dtype=True, k_slice_for=len, weight_packing=3)
    with pytest.raises(TypeError, match="WeightPacking.pack must be callable"):
        WeightPacking(packs=len, pack=None, project=len)
