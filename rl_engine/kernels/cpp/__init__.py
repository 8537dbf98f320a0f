"""C++ backend for CPU: fixed-order kernels built from `csrc/` as a torch extension.

Each op lives in its own file; this module exposes one function per op name of
`rl_engine.kernels.registry.OP_NAMES`, and `LAYOUT`, the layout facts callers
must follow (read through `rl_engine.kernels.backend_layout`). `linear`, `lm_head`, `silu`,
`attention` and `linear_logp` run the C++ kernels, and `moe_router` /
`moe_experts` compose them (and `LAYOUT.weight_packing` runs `linear` / `lm_head` on
weights packed once: packed_linear.py); `embedding`, `rms_norm`, `sigmoid` and
`log_softmax` are already invariant and fast in plain torch and are the native
ones. Which dtypes each op serves (fp32 and bf16 everywhere; fp64 / fp16 only
where a row-invariant path exists, else NonInvariantDtypeError): `_serving.py`.
Importing this module builds (or loads) the extension: a machine that
cannot build it gets the compiler's reason here, never a silent fallback.
"""

from rl_engine.kernels.cpp._extension import extension
from rl_engine.kernels.cpp.attention import attention
from rl_engine.kernels.cpp.linear import linear, lm_head
from rl_engine.kernels.cpp.linear_logp import linear_logp
from rl_engine.kernels.cpp.moe_experts import moe_experts
from rl_engine.kernels.cpp.moe_router import moe_router
from rl_engine.kernels.cpp.packed_linear import pack_weight, packed_projection, packs
from rl_engine.kernels.cpp.silu import silu
from rl_engine.kernels.native.embedding import embedding
from rl_engine.kernels.native.log_softmax import log_softmax
from rl_engine.kernels.native.rms_norm import rms_norm
from rl_engine.kernels.native.sigmoid import sigmoid
from rl_engine.kernels.registry import BackendLayout, WeightPacking

extension()

# Decode reads an fp32 slot cache in place, 16 positions (one score vector) at a time.
KEY_BLOCK = 16


def unsliced(dtype) -> int:
    """0: the GEMM never slices K (one fixed-order reduction over all of it)."""
    return 0


LAYOUT = BackendLayout(
    kv_block=KEY_BLOCK,
    kv_in_compute_dtype=True,
    k_slice_for=unsliced,
    weight_packing=WeightPacking(packs=packs, pack=pack_weight, project=packed_projection),
)

__all__ = [
    "LAYOUT",
    "attention",
    "embedding",
    "linear",
    "linear_logp",
    "lm_head",
    "log_softmax",
    "moe_experts",
    "moe_router",
    "rms_norm",
    "sigmoid",
    "silu",
]
