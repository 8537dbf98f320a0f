"""Native backend: batch-invariant ops written in plain torch (CPU, and any device).

Each op lives in its own file; this module exposes one function per op name of
`rl_engine.kernels.registry.OP_NAMES`.
"""

from rl_engine.kernels.native.attention import attention
from rl_engine.kernels.native.embedding import embedding
from rl_engine.kernels.native.linear import linear, lm_head
from rl_engine.kernels.native.linear_logp import linear_logp
from rl_engine.kernels.native.log_softmax import log_softmax
from rl_engine.kernels.native.rms_norm import rms_norm
from rl_engine.kernels.native.silu import silu

__all__ = [
    "attention",
    "embedding",
    "linear",
    "lm_head",
    "linear_logp",
    "log_softmax",
    "rms_norm",
    "silu",
]
