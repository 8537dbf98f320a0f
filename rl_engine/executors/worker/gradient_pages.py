"""A ZeRO-3 rank's gradient partitions handed back to the OS between steps.

DeepSpeed's stage 3 keeps every gradient partition of the rank in one flat buffer
(`grad_partitions_flat_buffer`: the bf16 gradients of the rank's share of the parameters,
471 MiB a rank for the 0.5B shape) from one step to the next. Nothing reads it between an
optimizer step and the next step's backward, which overwrites each partition at the
accumulation window's first micro-batch (`micro_step_id == 0`: a copy, not an add). Its
pages are released when a step ends, so the ranks rest without it while the engines
generate; the next backward maps fresh zero pages.

The bits stay those of a kept buffer where every parameter gets its gradient in the
window's first micro-batch, the buffer's padding (zeros from its allocation) read as zeros
again. A mixture-of-experts policy may leave an expert without a gradient in a micro-batch,
and DeepSpeed then reads its partition as the buffer holds it: there the buffer is kept.
"""

from __future__ import annotations

import logging

from rl_engine.base.memory_pages import anonymous_private, release_pages

log = logging.getLogger(__name__)


def release_gradient_partitions(optimizer, *, dense: bool) -> int:
    """Release the pages of ZeRO-3's flat gradient buffer after a step; returns the bytes
    released (0 when there is none on CPU, the policy is not `dense`, or the buffer is not
    in anonymous memory, whose released pages read zeros)."""
    buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if buffer is None or buffer.device.type != "cpu" or not dense:
        return 0
    if not anonymous_private(buffer):  # released pages would not read zeros: keep them
        log.warning("ZeRO-3's gradient buffer is not in anonymous memory; kept")
        return 0
    return release_pages(buffer, "ZeRO-3 grad_partitions_flat_buffer")
