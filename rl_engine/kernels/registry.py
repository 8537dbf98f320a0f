"""Op registry: `get_op(name, device, backend=None)` returns the implementation for that device.

The device is always an explicit argument (never a global default), so a worker
that owns a GPU and a rollout process on CPU can each ask for their own op.
The device type alone decides the backend:

- `cuda`: the Triton backend. If it cannot load, the lookup raises and says
  why; it never falls back. `backend="native"` must be asked for explicitly.
- `cpu`: the cpp backend (fixed-order C++ kernels built by `make setup`). If
  it cannot build or load, the lookup raises and says why; it never falls
  back (the two CPU backends give different bits). `backend="native"` (plain
  torch) must be asked for explicitly. `backend="triton"` is accepted only
  when the Triton backend was imported with `TRITON_INTERPRET=1` (Triton's
  CPU interpreter: tests only), and raises otherwise.

Which dtypes an op serves is its backend's promise, checked when the op is called:
a dtype the backend cannot compute row-invariantly raises NonInvariantDtypeError
(naming the op, backend and dtype), unless the caller asked for the op with
`get_op(name, device, allow_non_invariant=True)`. The flag is bound into the
function returned (never global state); docs/backends.md lists what each serves.

Backend-specific layout facts (the KV-cache block and dtype the rollout engine
must use) come from `backend_layout`, never from a backend's module.
Lookups fail loudly: an unknown op, device or backend lists what exists.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from rl_engine.kernels import devices
from rl_engine.kernels.common.op import opted_in

OP_NAMES = (
    "embedding",
    "linear",
    "lm_head",
    "rms_norm",
    "silu",
    "sigmoid",
    "log_softmax",
    "attention",
    "linear_logp",
    "moe_router",
    "moe_experts",
)

# backend name -> module that exposes one function per op name and a `LAYOUT`
_BACKEND_MODULES = {
    "cpp": "rl_engine.kernels.cpp",
    "native": "rl_engine.kernels.native",
    "triton": "rl_engine.kernels.triton",
}

# device type -> (default backend, other backends that may be asked for by name)
_DEVICE_BACKENDS = {
    "cpu": ("cpp", "native", "triton"),
    "cuda": ("triton", "native"),
}

INTERPRET_ENV = "TRITON_INTERPRET"


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


@dataclass(frozen=True, slots=True)
class WeightPacking:
    """A backend's GEMM weights packed once for forward-only callers (layout only: the same
    bits as `linear` / `lm_head` on the weight). A packed weight is a copy: the caller owns
    repacking it whenever the weight may have changed."""

    packs: Callable[[torch.Tensor], bool]
    """weight -> whether `pack` takes it (its dtype, shape and device)."""
    pack: Callable
    """`pack(weight, into=None)` -> a packed weight (repacked into `into`'s buffer when given)."""
    project: Callable
    """`project(x, packed, bias=None, out_dtype=None)`: `linear` (out_dtype None) or
    `lm_head` (out_dtype fp32) on the packed weight."""

    def __post_init__(self) -> None:
        for name in ("packs", "pack", "project"):
            if not callable(getattr(self, name)):
                raise TypeError(f"WeightPacking.{name} must be callable")


@dataclass(frozen=True, slots=True)
class BackendLayout:
    """Layout facts a caller must follow for a backend's numerics (e.g. the rollout KV cache)."""

    kv_block: int
    """The engine's KV-cache capacity is a multiple of this many positions (attention's key block)."""
    kv_in_compute_dtype: bool
    """True: the cache stores keys/values in the attention's compute dtype (fp32 for bf16
    models), which the op reads in place; False: in the model's own dtype."""
    k_slice_for: Callable[[torch.dtype], int]
    """dtype -> width of the fixed reduction slices of `linear` / `lm_head` on this machine."""
    weight_packing: WeightPacking | None = None
    """How this backend's GEMM weights are packed once (None: they are not)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kv_block, int) or self.kv_block < 1:
            raise ValueError(f"kv_block must be an int >= 1, got {self.kv_block!r}")
        if not callable(self.k_slice_for):
            raise TypeError("k_slice_for must be callable (dtype -> slice width)")
        if self.weight_packing is not None and not isinstance(self.weight_packing, WeightPacking):
            raise TypeError(
                f"weight_packing must be a WeightPacking or None, got {type(self.weight_packing).__name__}"
            )


def list_ops() -> list[str]:
    """Names of every op the registry knows."""
    return list(OP_NAMES)


def list_backends(device: str | torch.device) -> list[str]:
    """Backends that may serve `device`, the default first."""
    return list(_DEVICE_BACKENDS[devices.device_type(device)])


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU interpreter."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_backend(device: str | torch.device, backend: str | None = None) -> str:
    """Name of the backend that serves `device` (the default one when `backend` is None).

    Raises if that backend cannot load or may not serve the device; never falls back.
    """
    device_type = devices.device_type(device)
    allowed = _DEVICE_BACKENDS[device_type]
    name = allowed[0] if backend is None else backend
    if name not in _BACKEND_MODULES:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(_BACKEND_MODULES)}")
    if name not in allowed:
        raise ValueError(
            f"backend {name!r} does not serve device {device_type!r}; "
            f"backends for {device_type}: {', '.join(allowed)}"
        )
    module = _load(name, device_type, explicit=backend is not None)
    if device_type == "cpu" and name == "triton":
        if not (interpreter_enabled() and getattr(module, "INTERPRET", False)):
            raise ValueError(
                "backend 'triton' runs on cpu only under Triton's interpreter: set "
                f"{INTERPRET_ENV}=1 before rl_engine.kernels.triton is first imported "
                f"({INTERPRET_ENV}={os.environ.get(INTERPRET_ENV)!r}, triton backend loaded "
                f"{'with' if getattr(module, 'INTERPRET', False) else 'without'} the interpreter)"
            )
    return name


def get_op(
    name: str,
    device: str | torch.device,
    backend: str | None = None,
    *,
    allow_non_invariant: bool = False,
) -> Callable:
    """Return op `name` for `device`, from the device's default backend or the one named.

    cuda -> triton, cpu -> cpp; see the module docstring for the explicit cases.
    The op raises NonInvariantDtypeError when called with a dtype its backend does not
    compute row-invariantly; `allow_non_invariant=True` returns the same op without that
    check (the caller wants the result, not the guarantee: gradcheck in fp64).
    """
    if name not in OP_NAMES:
        raise KeyError(f"unknown op {name!r}; available ops: {', '.join(OP_NAMES)}")
    backend = resolve_backend(device, backend)
    module = _load_backend(backend)
    fn = getattr(module, name, None)
    if fn is None:
        provided = [op for op in OP_NAMES if hasattr(module, op)]
        raise RuntimeError(
            f"backend {backend!r} does not provide op {name!r}; it provides: "
            f"{', '.join(provided) or 'nothing'}"
        )
    impl = OpImpl(name=name, backend=backend, fn=fn)
    return opted_in(impl.fn) if allow_non_invariant else impl.fn


def backend_layout(device: str | torch.device, backend: str | None = None) -> BackendLayout:
    """Layout facts of the backend that serves `device` (see BackendLayout)."""
    layout = getattr(_load_backend(resolve_backend(device, backend)), "LAYOUT", None)
    if not isinstance(layout, BackendLayout):
        raise RuntimeError(f"backend {backend!r} does not define LAYOUT (a BackendLayout)")
    return layout


@cache
def _load_backend(backend: str):
    return importlib.import_module(_BACKEND_MODULES[backend])


def _load(backend: str, device_type: str, *, explicit: bool):
    try:
        return _load_backend(backend)
    except Exception as err:  # ImportError, or a broken install raising anything else
        how = "was requested" if explicit else f"is the backend of {device_type}"
        hint = (
            ""
            if explicit or backend == "native"
            else f"; pass backend='native' to run the plain-torch ops on {device_type} instead"
        )
        raise RuntimeError(
            f"backend {backend!r} {how} but cannot load: {type(err).__name__}: {err}{hint}"
        ) from err
