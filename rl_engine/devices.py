"""`check_device`: the one check of a `device` argument (worker, rollout engine)."""

from __future__ import annotations

import torch

SUPPORTED = ("cpu", "cuda")


def check_device(device, *, local_rank: int | None = None) -> torch.device:
    """`device` as a torch.device on cpu or cuda.

    TypeError when it is not a str or torch.device; ValueError when it does not
    parse, names another device type, or names cuda without CUDA in this process.
    With `local_rank`, a bare 'cuda' means cuda:<local_rank>.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"invalid device {device!r}: {err}") from None
    if device.type not in SUPPORTED:
        raise ValueError(f"unsupported device {str(device)!r}; supported: {', '.join(SUPPORTED)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available in this process")
    if device.type == "cuda" and device.index is None and local_rank is not None:
        device = torch.device("cuda", local_rank)
    return device
