"""What every Triton op shares: interpreter detection, dtypes, launch sizes, input checks.

Numerics switch: Triton's CPU interpreter (TRITON_INTERPRET=1) computes `tl.dot`
wrongly on bf16 tiles (FACTS.md), so under the interpreter every kernel casts
its dot operands to fp32 (`UPCAST=True`); on a GPU bf16 tiles go to the tensor
cores as they are. fp32 operands always use `input_precision="ieee"` (a GPU
would otherwise round them to TF32). Interpreter runs therefore check the
tiling, masking and reduction order; the GPU run checks the tensor-core path.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Read once, when the kernels are decorated: `triton.jit` returns an interpreted
# function only if TRITON_INTERPRET was set before this import.
try:
    INTERPRET: bool = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton without knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}

# Programs of a persistent kernel under the interpreter (programs run one after
# another there; a few of them exercise the persistent loop).
_INTERPRETER_PROGRAMS = 4


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 statistics and accumulation; fp64 stays fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_dtype(dtype: torch.dtype):
    return _TL_DTYPES[dtype]


def upcast_dot(dtype: torch.dtype) -> bool:
    """Cast dot operands to the compute dtype before tl.dot (always under the interpreter)."""
    return INTERPRET or dtype in (torch.float32, torch.float64)


def num_programs(device: torch.device, tiles: int) -> int:
    """Programs of a persistent launch: one per SM on a GPU, never more than the tiles."""
    slots = _sm_count(device.index) if device.type == "cuda" else _INTERPRETER_PROGRAMS
    return max(1, min(tiles, slots))


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_device(name: str, t: torch.Tensor) -> None:
    """Triton kernels run on cuda tensors, or on cpu tensors under the interpreter."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and INTERPRET):
        return
    raise ValueError(
        f"{name} is on {t.device}: the triton backend runs on cuda"
        + ("" if INTERPRET else " (cpu only under TRITON_INTERPRET=1)")
    )
