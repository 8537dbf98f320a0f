"""Errors the kernels raise that callers may want to catch by type."""

from __future__ import annotations


class NonInvariantDtypeError(ValueError):
    """An op was asked for a dtype its backend cannot compute row-invariantly.

    Raised when the op is called (the dtype is known only then), before anything is
    computed. The message names the op, the backend, the dtype, what would run instead
    and how to opt in: `get_op(name, device, allow_non_invariant=True)` returns the same
    op without this check, for callers that want the result and not the guarantee
    (gradcheck in fp64). Which dtypes each backend serves: docs/backends.md.
    """


class PlatformInvarianceError(NonInvariantDtypeError, RuntimeError):
    """A backend cannot guarantee its row-invariance contract for a dtype on this machine.

    Raised by the `native` backend when its start-up probe finds that a platform
    assumption its fixed-order GEMM rests on does not hold for that dtype (see
    rl_engine/kernels/native/platform_probe.py). Only that dtype is refused; the
    message names the dtype, the assumption and what to use instead. A measured
    refusal, so a NonInvariantDtypeError too (and a RuntimeError, as it always was).
    """
