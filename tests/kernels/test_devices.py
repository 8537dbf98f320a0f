"""The one device-argument check: a str or torch.device naming cpu or cuda; errors name the value."""

import pytest
import torch

from rl_engine.kernels.devices import check_device, device_type


@pytest.mark.parametrize(
    ("device", "kind"), [("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("cuda:1", "cuda")]
)
def test_device_type_parses_without_asking_for_cuda(device, kind):
    assert device_type(device) == kind


@pytest.mark.parametrize(
    ("device", "error", "message"),
    [
        (0, TypeError, "must be a str or torch.device, got int"),
        ("gpu0", ValueError, "invalid device 'gpu0'"),
        ("meta", ValueError, "unsupported device 'meta'; supported devices: cpu, cuda"),
    ],
)
def test_a_bad_device_names_itself(device, error, message):
    with pytest.raises(error, match=message):
        device_type(device)
    with pytest.raises(error, match=message):
        check_device(device)


def test_check_device_returns_a_torch_device_and_refuses_absent_cuda():
    assert check_device("cpu", local_rank=3) == torch.device("cpu")
    if torch.cuda.is_available():
        assert check_device("cuda", local_rank=1) == torch.device("cuda", 1)
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            check_device("cuda")
