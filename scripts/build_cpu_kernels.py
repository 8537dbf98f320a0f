"""Compile rl_engine's C++ CPU kernels now (`make setup`), not at the first kernel call.

Exits non-zero with the compiler's reason if the extension does not build, so
that setup fails instead of a run failing (or worse, running other kernels) later.
The build itself is rl_engine.kernels.cpp.build; importing that package already builds
the extension, so only an import inside the `try` below can turn a failed build into one
line.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from rl_engine.kernels.cpp.build import build

        build_dir, paths = build()
    except RuntimeError as err:
        print(f"rl_engine C++ kernels: {err}", file=sys.stderr)
        return 1
    print(f"rl_engine C++ kernels ready in {build_dir}; ISA paths: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
