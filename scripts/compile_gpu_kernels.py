"""Compile every Triton launch of the backend for NVIDIA targets, without a GPU, and check the binaries.

    python scripts/compile_gpu_kernels.py [--targets sm_80,sm_90,sm_100] [--out DIR] [--cases all|ci]
    python scripts/compile_gpu_kernels.py --launch --compare AOT/manifest.json --out DIR   (on a GPU)

Writes DIR/manifest.json and DIR/ptx/; exits 0 iff every launch compiles and every check
holds. The command lives in rl_engine/diagnostics/gpu_compile.py, the check in
rl_engine/kernels/triton/aot.py (the launch cases in aot_cases.py, the manifest format and
checks a-d in aot_manifest.py); `--help` lists the options.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Compiled kernels only: triton.jit reads TRITON_INTERPRET when rl_engine's kernels are
# decorated, at their import below, and the interpreter has no binaries.
os.environ.pop("TRITON_INTERPRET", None)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rl_engine.diagnostics.gpu_compile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
