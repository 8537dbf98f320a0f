"""Errors the kernels raise that callers may want to catch by type."""

from __future__ import annotations


class PlatformInvarianceError(RuntimeError):
    """A backend cannot guarantee its row-invariance contract for a dtype on this machine.

    Raised by the `native` backend when its start-up probe finds that a platform
    assumption its fixed-order GEMM rests on does not hold for that dtype (see
    rl_engine/kernels/native/platform_probe.py). Only that dtype is refused; the
    message names the dtype, the assumption and what to use instead.
    """
