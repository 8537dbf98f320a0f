"""Triton backend: batch-invariant GPU kernels with the native backend's contracts.

One op per file, like the native backend; this module exposes one function per
op name of `rl_engine.kernels.registry.OP_NAMES` and `LAYOUT`, the layout facts
callers follow (through `rl_engine.kernels.backend_layout`). Importing it needs
triton: a missing triton makes every cuda lookup fail loudly.

On a CPU the kernels run only under Triton's interpreter, which must be
switched on (TRITON_INTERPRET=1) before this module is first imported: `INTERPRET`
records whether it was. See docs/backends.md.
"""

from rl_engine.kernels.registry import BackendLayout
from rl_engine.kernels.triton._common import INTERPRET
from rl_engine.kernels.triton._matmul import BLOCK_K
from rl_engine.kernels.triton.attention import BLOCK_N, attention
from rl_engine.kernels.triton.embedding import embedding
from rl_engine.kernels.triton.linear import linear
from rl_engine.kernels.triton.linear_logp import linear_logp
from rl_engine.kernels.triton.lm_head import lm_head
from rl_engine.kernels.triton.log_softmax import log_softmax
from rl_engine.kernels.triton.rms_norm import rms_norm
from rl_engine.kernels.triton.silu import silu

# The kernels read any strided cache in place, in the model's dtype; a capacity
# in whole key blocks keeps every block load in bounds of one slot.
LAYOUT = BackendLayout(kv_block=BLOCK_N, kv_in_compute_dtype=False, k_slice_for=lambda _: BLOCK_K)

__all__ = [
    "INTERPRET",
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
