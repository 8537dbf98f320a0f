"""C++ backend for CPU: fixed-order kernels built from `csrc/` as a torch extension.

Each op lives in its own file; this module exposes one function per op name of
`rl_engine.kernels.registry.OP_NAMES`. `linear`, `lm_head`, `silu`,
`attention` and `linear_logp` run the C++ kernels; `embedding`, `rms_norm` and
`log_softmax` are already invariant and fast in plain torch and are the native
ones. Importing this module builds (or loads) the extension: a machine that
cannot build it gets the compiler's reason here, never a silent fallback.
"""

from rl_engine.kernels.cpp._extension import extension
from rl_engine.kernels.cpp.attention import attention
from rl_engine.kernels.cpp.linear import linear, lm_head
from rl_engine.kernels.cpp.linear_logp import linear_logp
from rl_engine.kernels.cpp.silu import silu
from rl_engine.kernels.native.embedding import embedding
from rl_engine.kernels.native.log_softmax import log_softmax
from rl_engine.kernels.native.rms_norm import rms_norm

extension()

__all__ = [
    "attention",
    "embedding",
    "linear",
    "linear_logp",
    "lm_head",
    "log_softmax",
    "rms_norm",
    "silu",
]
