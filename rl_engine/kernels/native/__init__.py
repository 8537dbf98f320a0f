"""Native backend: batch-invariant ops written in plain torch (CPU, and any device).

Each op lives in its own file; this module exposes one function per op name of
`rl_engine.kernels.registry.OP_NAMES`, and `LAYOUT`, the layout facts callers
must follow (read through `rl_engine.kernels.backend_layout`).
"""

from rl_engine.kernels.native._gemm import k_slice_for
from rl_engine.kernels.native.attention import BLOCK_K
from rl_engine.kernels.native.attention import attention as attention
from rl_engine.kernels.native.embedding import embedding as embedding
from rl_engine.kernels.native.linear import linear as linear
from rl_engine.kernels.native.linear import lm_head as lm_head
from rl_engine.kernels.native.linear_logp import linear_logp as linear_logp
from rl_engine.kernels.native.log_softmax import log_softmax as log_softmax
from rl_engine.kernels.native.moe_experts import moe_experts as moe_experts
from rl_engine.kernels.native.moe_router import moe_router as moe_router
from rl_engine.kernels.native.rms_norm import rms_norm as rms_norm
from rl_engine.kernels.native.sigmoid import sigmoid as sigmoid
from rl_engine.kernels.native.silu import silu as silu
from rl_engine.kernels.registry import OP_NAMES, BackendLayout

# Decode reads an fp32 cache whose capacity is a multiple of BLOCK_K in place.
LAYOUT = BackendLayout(kv_block=BLOCK_K, kv_in_compute_dtype=True, k_slice_for=k_slice_for)

# One function per op name (re-exported above as `name as name`), and the layout facts.
__all__ = ["LAYOUT", *OP_NAMES]
