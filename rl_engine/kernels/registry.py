"""Op registry: `get_op(name, device)` returns the implementation for that device.

The device is always an explicit argument (never a global default), so a worker
that owns a GPU and a rollout process on CPU can each ask for their own op.
Lookups fail loudly: an unknown op or device lists what exists, and a backend
that was asked for by name but cannot load raises instead of falling back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

OP_NAMES = (
    "embedding",
    "linear",
    "lm_head",
    "rms_norm",
    "silu",
    "log_softmax",
    "attention",
    "linear_logp",
)

# backend name -> module that exposes one function per op name
_BACKEND_MODULES = {
    "cpp": "rl_engine.kernels.cpp",
    "native": "rl_engine.kernels.native",
    "triton": "rl_engine.kernels.triton",
}

# device type -> backends to try, in order of preference, when none is requested.
# The Triton backend is preferred on GPUs once it provides the op. On CPUs the
# C++ backend is the default; if it cannot build or load, the lookup raises
# (it never falls back to native: the two give different bits).
_DEVICE_BACKENDS = {
    "cpu": ("cpp", "native"),
    "cuda": ("triton", "native"),
}


@dataclass(frozen=True, slots=True)
class OpImpl:
    """One implementation of one op on one backend."""

    name: str
    backend: str
    fn: Callable

    def __post_init__(self) -> None:
        if self.name not in OP_NAMES:
            raise ValueError(f"unknown op {self.name!r}; known ops: {', '.join(OP_NAMES)}")
        if self.backend not in _BACKEND_MODULES:
            raise ValueError(
                f"unknown backend {self.backend!r}; known backends: {', '.join(_BACKEND_MODULES)}"
            )
        if not callable(self.fn):
            raise TypeError(f"op {self.name!r} of backend {self.backend!r} is not callable")


def list_ops() -> list[str]:
    """Names of every op the registry knows."""
    return list(OP_NAMES)


def list_backends(device: str | torch.device) -> list[str]:
    """Backends that may serve `device`, most preferred first."""
    return list(_DEVICE_BACKENDS[_device_type(device)])


def get_op(name: str, device: str | torch.device, *, backend: str | None = None) -> Callable:
    """Return op `name` for `device`.

    With `backend=None` the first backend of the device that loads and provides
    the op is used (cuda: triton, then native). With an explicit `backend`, that
    backend must load and provide the op, or this raises.
    """
    if name not in OP_NAMES:
        raise KeyError(f"unknown op {name!r}; available ops: {', '.join(OP_NAMES)}")
    device_type = _device_type(device)
    if backend is not None:
        if backend not in _DEVICE_BACKENDS[device_type]:
            raise ValueError(
                f"backend {backend!r} does not serve device {device_type!r}; "
                f"backends for {device_type}: {', '.join(_DEVICE_BACKENDS[device_type])}"
            )
        return _lookup(name, backend, required=True).fn
    for candidate in _DEVICE_BACKENDS[device_type]:
        impl = _lookup(name, candidate, required=False)
        if impl is not None:
            return impl.fn
    raise RuntimeError(f"no backend provides op {name!r} on {device_type}")  # pragma: no cover


def _device_type(device: str | torch.device) -> str:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device_type = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"invalid device {device!r}: {err}") from None
    if device_type not in _DEVICE_BACKENDS:
        raise ValueError(
            f"unsupported device {device_type!r}; supported devices: {', '.join(_DEVICE_BACKENDS)}"
        )
    return device_type


@cache
def _load_backend(backend: str):
    return importlib.import_module(_BACKEND_MODULES[backend])


def _lookup(name: str, backend: str, *, required: bool) -> OpImpl | None:
    try:
        module = _load_backend(backend)
    except ImportError as err:
        if required or backend == "cpp":
            raise RuntimeError(f"backend {backend!r} was requested but cannot load: {err}") from err
        return None
    fn = getattr(module, name, None)
    if fn is None:
        if required:
            provided = [op for op in OP_NAMES if hasattr(module, op)]
            raise RuntimeError(
                f"backend {backend!r} does not provide op {name!r}; it provides: "
                f"{', '.join(provided) or 'nothing yet'}"
            )
        return None
    return OpImpl(name=name, backend=backend, fn=fn)
