"""Build the C++ kernels now, not at their first call (`make setup`: scripts/build_cpu_kernels.py).

Importing this module imports `rl_engine.kernels.cpp`, which builds (or loads) the extension:
a failed build raises RuntimeError with the compiler's reason at that import.
"""

from __future__ import annotations

from pathlib import Path

from rl_engine.kernels.cpp._extension import BUILD_DIR, extension, supported_isas


def build() -> tuple[Path, list[str]]:
    """Build (or load) the extension: (its build folder, the ISA paths this CPU runs, fastest first)."""
    extension()
    return BUILD_DIR, supported_isas()
