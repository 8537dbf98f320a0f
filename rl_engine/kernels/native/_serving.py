"""What the native backend promises: every floating dtype, where this machine's probe accepts it.

The GEMM ops (`linear`, `lm_head`, `linear_logp`, `moe_router`, `moe_experts`) and
`attention` (its scores and p @ v are fixed-shape `torch.bmm` calls, library GEMMs
like the tiles') rest on one platform assumption that `platform_probe.py` measures per
dtype and process; a dtype it refuses raises PlatformInvarianceError there. The other
ops (`PLAIN`) call no library GEMM and are invariant by their formulation in every dtype.
"""

from __future__ import annotations

from rl_engine.kernels.common.op import Serving
from rl_engine.kernels.native.platform_probe import platform_refusal

PLAIN = Serving(backend="native")
GEMM = Serving(backend="native", platform_refusal=platform_refusal)
