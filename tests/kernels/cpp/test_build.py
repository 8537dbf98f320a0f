"""Building the C++ kernels ahead of use (cpp/build.py, `make setup`).

Checks: `build()` returns the extension's own build folder (inside the package, holding the
compiled library) and the instruction-set paths this CPU runs, fastest first, a subset of
the known paths that every CPU able to run the kernels has at least `avx2` of.
"""

import rl_engine.kernels.cpp._extension as cpp_extension
from rl_engine.kernels.cpp.build import build


def test_build_returns_the_build_folder_and_this_cpus_paths_fastest_first():
    folder, isas = build()
    assert folder == cpp_extension.BUILD_DIR and folder.is_dir()
    assert folder.parent == cpp_extension.CSRC.parent  # one build per checkout, never shared
    assert any(folder.glob(f"{cpp_extension.EXTENSION_NAME}*.so")), sorted(folder.iterdir())
    assert isas == cpp_extension.supported_isas() and "avx2" in isas
    order = [cpp_extension.ISA_PATHS.index(isa) for isa in isas]
    assert order == sorted(order)
    assert build() == (folder, isas)  # a second call loads, it does not rebuild
