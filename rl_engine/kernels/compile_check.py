"""The Triton backend's ahead-of-time compile check, as the kernels' public face: code outside
`kernels/` never imports a backend, so the command line (`rl_engine/diagnostics/gpu_compile.py`)
reaches the check through these names.

- `CASES`, `SHARED_LIMITS`: every op's launch cases; the targets and their shared-memory limits;
- `compile_targets` / `launch_on_gpu`: capture each case's launches and compile them for NVIDIA
  targets through a stub driver (no GPU), or launch them on this machine's GPU;
- `require_compiled_kernels`: refuses kernels decorated under TRITON_INTERPRET;
- `check`, `compare`, `summary`: the manifest's checks a-d and the shared-memory limit, the
  launched-vs-ahead-of-time hash comparison, and the counts.

Importing it imports triton (the backend's package), so only the compile command does.
"""

from rl_engine.kernels.triton.aot import (
    CASES,
    compile_targets,
    launch_on_gpu,
    require_compiled_kernels,
)
from rl_engine.kernels.triton.aot_manifest import SHARED_LIMITS, check, compare, summary

__all__ = [
    "CASES",
    "SHARED_LIMITS",
    "check",
    "compare",
    "compile_targets",
    "launch_on_gpu",
    "require_compiled_kernels",
    "summary",
]
