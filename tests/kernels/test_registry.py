import pytest
import torch

from rl_engine.kernels import OP_NAMES, cpp, get_op, list_backends, list_ops
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
    assert list_backends("cpu") == ["cpp", "native"]
    for name in OP_NAMES:
        assert get_op(name, "cpu") is getattr(cpp, name), name
        native_fn = get_op(name, "cpu", backend="native")
        assert native_fn.__module__.startswith("rl_engine.kernels.native"), name
    assert get_op("linear_logp", torch.device("cpu"), backend="native") is linear_logp
    assert get_op("attention", "cpu", backend="native") is attention


def test_device_is_explicit_and_cuda_falls_back_to_native_until_triton_provides_the_op():
    assert list_backends("cuda:1") == ["triton", "native"]
    assert get_op("linear_logp", "cuda") is linear_logp  # triton backend provides nothing yet
    with pytest.raises(TypeError, match="device must be a str or torch.device"):
        get_op("linear", None)


def test_unknown_op_lists_the_ops():
    with pytest.raises(KeyError, match="available ops: embedding, linear"):
        get_op("matmul", "cpu")


def test_unsupported_device_lists_the_devices():
    with pytest.raises(ValueError, match="unsupported device 'mps'; supported devices: cpu, cuda"):
        get_op("linear", "mps")
    with pytest.raises(ValueError, match="invalid device"):
        get_op("linear", "not-a-device")


def test_explicit_backend_never_falls_back():
    with pytest.raises(RuntimeError, match="backend 'triton' does not provide op 'linear'"):
        get_op("linear", "cuda", backend="triton")
    with pytest.raises(ValueError, match="backend 'triton' does not serve device 'cpu'"):
        get_op("linear", "cpu", backend="triton")
