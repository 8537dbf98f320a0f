"""Whether this machine's platform probe lets an attention test run, for the attention tests.

Native's attention runs fixed-shape library GEMMs (`torch.bmm`), so where native's probe
refuses a dtype it raises PlatformInvarianceError, and so does cpp's attention for fp64 /
fp16 (it runs native's forward there). `skip_if_attention_refused` asks the op itself, so a
test skips with the op's own refusal, and runs (and must pass) where the probe accepts.
"""

from __future__ import annotations

import functools

import pytest
import torch

from rl_engine.kernels import PlatformInvarianceError, get_op
from tests.helpers.invariance import REFUSAL

PROBED_BACKENDS = ("cpp", "native")  # triton's attention asks no platform probe


@functools.cache
def attention_refusal(backend: str, dtype: torch.dtype, device: str = "cpu") -> str | None:
    """The PlatformInvarianceError message of `backend`'s attention for `dtype` here, or None."""
    if backend not in PROBED_BACKENDS:
        return None
    attention = get_op("attention", device, backend=backend)
    one = torch.zeros(1, 1, 1, 8, dtype=dtype, device=device)
    try:
        attention(one, one, one, q_positions=torch.zeros(1, 1, dtype=torch.long, device=device))
    except PlatformInvarianceError as err:
        return str(err)
    return None


def skip_if_attention_refused(backend: str, dtype: torch.dtype, device: str = "cpu") -> None:
    """Skip the calling test, with the op's reason, where `backend`'s attention refuses `dtype`."""
    reason = attention_refusal(backend, dtype, device)
    if reason is not None:
        pytest.skip(f"{REFUSAL}: {reason}")


def skip_if_case_refused(request, backend: str, default: torch.dtype = torch.float32) -> None:
    """`skip_if_attention_refused` for the requesting test's `dtype` parameter (`default`, the
    dtype of tests without one): one call in a module's backend fixture covers its tests."""
    callspec = getattr(request.node, "callspec", None)
    dtype = callspec.params.get("dtype", default) if callspec is not None else default
    skip_if_attention_refused(backend, dtype)


def served_dtypes(backend: str, dtypes) -> tuple[torch.dtype, ...]:
    """The `dtypes` `backend`'s attention serves here (a thread-count snippet runs those);
    skips the calling test when it serves none of them."""
    served = tuple(d for d in dtypes if attention_refusal(backend, d) is None)
    if not served:
        pytest.skip(f"{REFUSAL}: {attention_refusal(backend, dtypes[0])}")
    return served
