"""One description per kernel launch: what an op runs is what the ahead-of-time compile check compiles.

Every Triton op builds its launches with a `*_launch` function that returns a
`Launch`: the kernel, the grid, the runtime arguments, the constexprs, and the
compiler options that shape the numerics (`num_warps` shapes a reduction's
tree, `enable_fp_fusion` decides whether `a * b + c` is one FMA or two
roundings). The op calls `launch.run()`; `scripts/compile_gpu_kernels.py`
runs the op's own Python path on CPU tensors inside `capture_launches()`,
which records each Launch instead of running it and compiles it with the JIT's
own specialisation (`Launch.warmup`). Nothing else launches a kernel.

FP fusion is pinned OFF at every launch (`FP_FUSION`): each `*` and `+` in a
kernel is rounded as written. That is the default Triton announces for 3.10
(3.9 fuses by default), and `TRITON_FORCE_DISABLE_FP_FUSION` cannot change a
launch that already disables it, so no Triton upgrade or environment variable
flips the bits. `tl.dot` is an MMA (or, for fp32 `ieee`, an FMA chain)
either way: the option does not reach inside a dot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# The FP-contraction setting of every Triton launch of this backend (kernel_facts records it).
FP_FUSION = False

# The version of this backend's numerics (kernel_facts records it, as the cpp backend's
# `serialk-v1`): change it with any change that moves a bit on a GPU (tile sizes, split
# size, num_warps, reduction order, rounding functions, FP fusion, the specialisation).
NUMERICS_VERSION = "tritonk-v3"  # v3: rms_norm grad x by a row kernel

_captured: list[Launch] | None = None


@dataclass(frozen=True, eq=False)
class Launch:
    """One kernel launch, complete: grid, arguments, constexprs and numerics options."""

    variant: str
    """The op's name for this kernel and its constexpr choice (a manifest group: one binary)."""
    kernel: Any
    """The `triton.jit` function."""
    grid: tuple[int, ...]
    args: tuple
    """Runtime arguments, in the kernel's order (tensors and Python scalars)."""
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1
    fp_fusion: bool = FP_FUSION

    def options(self) -> dict[str, Any]:
        """The compiler options of this launch (part of the numerics)."""
        return {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "enable_fp_fusion": self.fp_fusion,
        }

    def run(self) -> None:
        """Launch the kernel, or record the launch inside `capture_launches()`."""
        if _captured is not None:
            _captured.append(self)
            return
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options())

    def warmup(self):
        """Compile without launching (the active driver's target) and return the CompiledKernel."""
        return self.kernel.warmup(*self.args, grid=(1,), **self.constexprs, **self.options())


def capturing() -> bool:
    """True inside `capture_launches()` (the ops then accept CPU tensors: nothing runs)."""
    return _captured is not None


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Record every Launch the ops make instead of running it (for the compile check).

    The ops run their real Python path (argument checks, layout, tile planning);
    their outputs are left unwritten.
    """
    global _captured
    if _captured is not None:
        raise RuntimeError("capture_launches() does not nest")
    _captured = []
    try:
        yield _captured
    finally:
        _captured = None
