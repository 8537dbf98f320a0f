"""The one check of a `device` argument: `device_type` (kernel registry) and `check_device`
(worker, rollout engine: also that CUDA is there). Imports torch only, so every layer may use it."""

from __future__ import annotations

import torch

SUPPORTED = ("cpu", "cuda")


def device_type(device) -> str:
    """The type ('cpu' or 'cuda') of a `device` argument; does not ask whether CUDA is present.

    TypeError when it is not a str or torch.device; ValueError when it does not parse or
    names another device type.
    """
    return _parse(device).type


def check_device(device, *, local_rank: int | None = None) -> torch.device:
    """`device` as a torch.device on cpu or cuda.

    The errors of `device_type`, and a ValueError for cuda without CUDA in this process.
    With `local_rank`, a bare 'cuda' means cuda:<local_rank>.
    """
    device = _parse(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available in this process")
    if device.type == "cuda" and device.index is None and local_rank is not None:
        device = torch.device("cuda", local_rank)
    return device


def _parse(device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"invalid device {device!r}: {err}") from None
    if device.type not in SUPPORTED:
        raise ValueError(
            f"unsupported device {str(device)!r}; supported devices: {', '.join(SUPPORTED)}"
        )
    return device
