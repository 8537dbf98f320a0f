"""Vocabulary projection on the GPU: hidden (..., H) @ W^T -> fp32 logits (..., V).

The same persistent fixed-order matmul as `linear` (its `PROJECTION`), stored
without rounding to the input dtype: logits never pass through a bf16 rounding
of the full sum. Tied weights work: `weight` may be the embedding matrix. The
op's signature and checks: rl_engine/kernels/common/linear.py.
"""

from __future__ import annotations

from rl_engine.kernels.common.linear import lm_head_op
from rl_engine.kernels.triton._common import SERVING
from rl_engine.kernels.triton.linear import PROJECTION

lm_head = lm_head_op(PROJECTION, SERVING, __name__)
