"""Build, load and dispatch the fixed-order C++ kernels (`csrc/`).

The extension is compiled from source with the system C++ compiler by
`torch.utils.cpp_extension` into `_build/` next to this file (one build per
checkout, never a shared cache). `make setup` builds it; at run time `load`
only re-links when a source changed. There is no prebuilt binary and no
fallback: if it cannot build, this raises with the compiler's reason.
Numerics: see csrc/gemm_impl.h (the GEMM's serial K chain) and
csrc/kernels_impl.h; NUMERICS_VERSION names them in `kernel_facts`.

Instruction-set paths: `avx512_bf16`, `avx512` and `avx2` are compiled into
the one library; the fastest one this CPU runs is used unless
`RL_ENGINE_CPU_ISA` names another. fp32 results are the same bits on every
path (the AVX2 code emulates the 16 lanes of AVX-512 with two registers). bf16
dot products use VDPBF16PS on `avx512_bf16` and an FMA emulation of it on the
others: equal bits except that the instruction flushes subnormals, so the
bf16 dot flavour is part of the parity contract (`kernel_facts`).
"""

from __future__ import annotations

import os
import shutil
from functools import cache
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
BUILD_DIR = Path(__file__).parent / "_build"
EXTENSION_NAME = "rl_engine_cpu_kernels"
SOURCES = ("bindings.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "isa_avx512_bf16.cpp")
# -ffp-contract=off: the compiler must never fuse a mul and an add on its own;
# every FMA in the kernels is written out, identically on every ISA.
# -fopenmp: at::parallel_for is a header template; without it the kernels'
# `#pragma omp parallel` is ignored and every call runs on one thread.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)

ISA_ENV = "RL_ENGINE_CPU_ISA"
# Fastest first: the default is the first one the CPU supports.
ISA_PATHS = ("avx512_bf16", "avx512", "avx2")
# Version of the numerics of these kernels: bump it whenever any kernel's bits change.
NUMERICS_VERSION = "serialk-v1"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(
            f"the rl_engine CPU kernels need a C++ compiler, but {cxx!r} was not found "
            "(install g++, e.g. `apt-get install g++`, or set CXX), then run `make setup`. "
            "The plain-torch kernels stay available with get_op(..., backend='native')."
        )
    return cxx


@cache
def extension():
    """The compiled module (built on first use if `make setup` did not build it)."""
    _compiler()
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(exist_ok=True)
    try:
        return load(
            name=EXTENSION_NAME,
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(BUILD_DIR),
            verbose=False,
        )
    except Exception as err:  # the compiler's output is in err
        raise RuntimeError(f"building the rl_engine CPU kernels failed: {err}") from err


def supported_isas() -> list[str]:
    """Instruction-set paths this CPU can run, fastest first."""
    return [isa for isa in ISA_PATHS if extension().isa_supported(isa)]


def current_isa() -> str:
    """The path every kernel call uses now: `RL_ENGINE_CPU_ISA` if set, else the fastest."""
    return _resolve_isa(os.environ.get(ISA_ENV, ""))


@cache
def _resolve_isa(requested: str) -> str:
    supported = supported_isas()
    if not supported:
        raise RuntimeError(
            "the rl_engine CPU kernels need AVX2 and FMA, which this CPU lacks; "
            "use get_op(..., backend='native')"
        )
    if not requested:
        return supported[0]
    if requested not in ISA_PATHS:
        raise ValueError(f"{ISA_ENV}={requested!r} is unknown; known paths: {', '.join(ISA_PATHS)}")
    if requested not in supported:
        raise ValueError(
            f"{ISA_ENV}={requested!r} is not supported by this CPU; supported: {', '.join(supported)}"
        )
    return requested


def bf16_dot_flavour(isa: str) -> str:
    """How bf16 pairs are multiplied and added (the only bit difference between paths)."""
    return "vdpbf16ps" if isa == "avx512_bf16" else "fma_pairs"
