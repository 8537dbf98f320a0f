"""Triton backend: batch-invariant GPU kernels with the native backend's contracts.

One op per file, like the native backend; this module exposes one function per
op name of `rl_engine.kernels.registry.OP_NAMES` and `LAYOUT`, the layout facts
callers follow (through `rl_engine.kernels.backend_layout`). Importing it needs
triton: a missing triton makes every cuda lookup fail loudly.

On a CPU the kernels run only under Triton's interpreter, which must be
switched on (TRITON_INTERPRET=1) before this module is first imported: `INTERPRET`
records whether it was. See docs/backends.md.
"""

from rl_engine.kernels.registry import OP_NAMES, BackendLayout
from rl_engine.kernels.triton._common import INTERPRET
from rl_engine.kernels.triton._matmul import BLOCK_K
from rl_engine.kernels.triton.attention import BLOCK_N
from rl_engine.kernels.triton.attention import attention as attention
from rl_engine.kernels.triton.embedding import embedding as embedding
from rl_engine.kernels.triton.linear import linear as linear
from rl_engine.kernels.triton.linear_logp import linear_logp as linear_logp
from rl_engine.kernels.triton.lm_head import lm_head as lm_head
from rl_engine.kernels.triton.log_softmax import log_softmax as log_softmax
from rl_engine.kernels.triton.moe_experts import moe_experts as moe_experts
from rl_engine.kernels.triton.moe_router import moe_router as moe_router
from rl_engine.kernels.triton.rms_norm import rms_norm as rms_norm
from rl_engine.kernels.triton.sigmoid import sigmoid as sigmoid
from rl_engine.kernels.triton.silu import silu as silu

# The kernels read any strided cache in place, in the model's dtype; a capacity
# in whole key blocks keeps every block load in bounds of one slot.
LAYOUT = BackendLayout(kv_block=BLOCK_N, kv_in_compute_dtype=False, k_slice_for=lambda _: BLOCK_K)

# One function per op name (re-exported above as `name as name`), and the layout facts.
__all__ = ["INTERPRET", "LAYOUT", *OP_NAMES]
