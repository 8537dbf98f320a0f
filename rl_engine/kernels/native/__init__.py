"""Native backend: batch-invariant ops written in plain torch (CPU, and any device).

Each op lives in its own file; this module exposes one function per op name of
`rl_engine.kernels.registry.OP_NAMES`, and `LAYOUT`, the layout facts callers
must follow (read through `rl_engine.kernels.backend_layout`).
"""

from rl_engine.kernels.native._gemm import k_slice_for
from rl_engine.kernels.native.attention import BLOCK_K, attention
from rl_engine.kernels.native.embedding import embedding
from rl_engine.kernels.native.linear import linear, lm_head
from rl_engine.kernels.native.linear_logp import linear_logp
from rl_engine.kernels.native.log_softmax import log_softmax
from rl_engine.kernels.native.rms_norm import rms_norm
from rl_engine.kernels.native.silu import silu
from rl_engine.kernels.registry import BackendLayout

# Decode reads an fp32 cache whose capacity is a multiple of BLOCK_K in place.
LAYOUT = BackendLayout(kv_block=BLOCK_K, kv_in_compute_dtype=True, k_slice_for=k_slice_for)

__all__ = [
    "LAYOUT",
    "attention",
    "embedding",
    "linear",
    "lm_head",
    "linear_logp",
    "log_softmax",
    "rms_norm",
    "silu",
]
