"""What every op of every backend shares: its guard (device check, dtype gate) and its opt-in twin.

An op is written once, in `common/<op>.py`: one builder that takes a backend's kernels
and a guard and returns the public function (its signature, its argument checks, then
`guard(name, tensor)`, then the kernels). A backend file supplies only its kernels and a
`Serving`, and calls `define_op`, which builds the op twice:

- the strict op, the backend module's attribute and what `get_op(name, device)` returns:
  its guard raises NonInvariantDtypeError for a dtype the backend does not compute
  row-invariantly, and PlatformInvarianceError where a measured platform check refuses one;
- its twin, `opted_in(op)`, what `get_op(..., allow_non_invariant=True)` returns: the same
  op whose guard checks the device only. The flag is bound into the function get_op hands
  out (two closures), never read from global state.

The dtype is known only at call time, so that is where the gate runs: after the argument
checks (a bad input gets its own error first), before anything is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_engine.kernels.common.checks import FLOAT_DTYPES
from rl_engine.kernels.errors import NonInvariantDtypeError, PlatformInvarianceError

# (name of the tensor, the tensor) -> None, or raises
Guard = Callable[[str, torch.Tensor], None]

_TWIN = "allowing_non_invariant"


@dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """What one backend promises for one op: where its kernels run, which dtypes they keep invariant."""

    backend: str
    invariant_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    """Dtypes whose rows the op computes invariantly; any other raises unless opted in."""
    otherwise: str = ""
    """What the other dtypes run instead (the error names it)."""
    check_device: Callable[[str, torch.Tensor], None] | None = None
    """The backend's device check (never skipped, not even by the opt-in)."""
    platform_refusal: Callable[[torch.dtype, str], str | None] | None = None
    """(dtype, device type) -> why this machine refuses an invariant dtype, or None (measured)."""

    def __post_init__(self) -> None:
        unknown = [d for d in self.invariant_dtypes if d not in FLOAT_DTYPES]
        if unknown:
            raise ValueError(f"invariant_dtypes must be floating dtypes, got {unknown}")
        if self.otherwise == "" and set(self.invariant_dtypes) != set(FLOAT_DTYPES):
            raise ValueError("a Serving that refuses a dtype must say what would run instead")

    def guard(self, op: str, *, allow_non_invariant: bool) -> Guard:
        """The check an op of this backend runs on the tensor that sets its dtype."""

        def guard(name: str, t: torch.Tensor) -> None:
            if self.check_device is not None:
                self.check_device(name, t)
            if allow_non_invariant:
                return
            if t.dtype not in self.invariant_dtypes:
                raise NonInvariantDtypeError(self.refusal(op, t.dtype))
            if self.platform_refusal is not None:
                reason = self.platform_refusal(t.dtype, t.device.type)
                if reason is not None:
                    raise PlatformInvarianceError(f"{reason} Or {opt_in_hint(op)}")

        return guard

    def refusal(self, op: str, dtype: torch.dtype) -> str:
        served = [_name(d) for d in self.invariant_dtypes]
        return (
            f"op {op!r} of backend {self.backend!r} is not row-invariant for {_name(dtype)}: "
            f"it serves {' and '.join(served)} invariantly; {_name(dtype)} would run "
            f"{self.otherwise}. Compute in {' or '.join(served)}, or {opt_in_hint(op)}"
        )


def opt_in_hint(op: str) -> str:
    return (
        f"pass allow_non_invariant=True to get_op({op!r}, device, ...) to run it without the "
        "row-invariance guarantee (e.g. for gradcheck)."
    )


def define_op(op: str, module: str, serving: Serving, build: Callable[[Guard], Callable]):
    """The strict op `build(guard)` for this backend, named as the backend module's `op`, with
    its opt-in twin attached (see `opted_in`)."""
    strict = _named(build(serving.guard(op, allow_non_invariant=False)), op, module)
    twin = _named(build(serving.guard(op, allow_non_invariant=True)), op, module)
    setattr(strict, _TWIN, twin)
    setattr(twin, _TWIN, twin)
    return strict


def opted_in(fn: Callable) -> Callable:
    """The twin of an op built by `define_op`: its guard checks the device only."""
    twin = getattr(fn, _TWIN, None)
    if twin is None:
        raise RuntimeError(
            f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)} was not built by "
            "common.op.define_op: it has no allow_non_invariant twin"
        )
    return twin


def _named(fn: Callable, op: str, module: str) -> Callable:
    fn.__module__, fn.__name__, fn.__qualname__ = module, op, op
    return fn


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
