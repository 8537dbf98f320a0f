"""What every Triton op shares: interpreter detection, dtypes, launch sizes, input checks.

Numerics switch: Triton's CPU interpreter (TRITON_INTERPRET=1) computes `tl.dot`
wrongly on bf16 tiles (FACTS.md), so under the interpreter every kernel casts
its dot operands to fp32 (`UPCAST=True`); on a GPU bf16 tiles go to the tensor
cores as they are. fp32 operands always use `input_precision="ieee"` (a GPU
would otherwise round them to TF32). Interpreter runs therefore check the
tiling, masking and reduction order; the GPU run checks the tensor-core path.
Under the interpreter `tl.dot` itself is pinned to a fixed-order sum over K
(`_pin_interpreter_dot`): the interpreter's own dot calls the host BLAS, whose
row bits depend on the row's position on some CPUs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.op import Serving
from rl_engine.kernels.triton._launch import capturing

# Read once, when the kernels are decorated: `triton.jit` returns an interpreted
# function only if TRITON_INTERPRET was set before this import.
try:
    INTERPRET: bool = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton without knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _pin_interpreter_dot() -> None:
    """Under the interpreter, `tl.dot` sums over K in a fixed order instead of calling the host BLAS.

    The interpreter computes `tl.dot` with `np.matmul`, i.e. the CPU's BLAS, whose result
    for a row can depend on the row's position in the tile: OpenBLAS's Haswell sgemm (an
    AVX2-only EPYC) gave different bits for the same row at row 0 and row 15 of a 16 x 64 @
    64 x 128 product. That is the host library's numerics, not a GPU's, and it made the
    interpreter tests of row invariance fail on that CPU only. Here a tile's dot is the
    serial chain a[:, 0] b[0] + a[:, 1] b[1] + ... (each product and sum rounded in the
    accumulator's dtype), then added to the accumulator, the same for every row and every
    CPU, so the interpreter tests check what they are for: the kernels' tiling, masking
    and reduction order.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_rl_engine_fixed_order", False):
        return
    plain_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out_dtype = d.data.dtype
        if out_dtype not in (np.float32, np.float64) or a.data.ndim != 2:
            return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = a.data.astype(out_dtype), b.data.astype(out_dtype)  # (M, K), (K, N)
        part = np.zeros((x.shape[0], y.shape[1]), dtype=out_dtype)  # (M, N)
        for k in range(x.shape[1]):
            part += x[:, k : k + 1] * y[k : k + 1, :]
        # like np.matmul(a, b) + d (and an MMA's result added to its accumulator): the tile's
        # dot first, then the running sum, so the K step stays part of the numerics
        return interpreter.TensorHandle(part + d.data, d.dtype.scalar)

    create_dot._rl_engine_fixed_order = True
    builder.create_dot = create_dot


if INTERPRET:
    _pin_interpreter_dot()

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
    """Triton kernels run on cuda tensors, or on cpu tensors under the interpreter (or while the
    compile check records launches: nothing runs then)."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and (INTERPRET or capturing())):
        return
    raise ValueError(
        f"{name} is on {t.device}: the triton backend runs on cuda"
        + ("" if INTERPRET else " (cpu only under TRITON_INTERPRET=1)")
    )


# Every op: cuda tensors (or cpu under the interpreter), and every floating dtype. The
# kernels' tiles and orders are constants and no argument that changes with the batch
# is specialised, so a row's bits are fixed by construction in any dtype (fp64 accumulates
# in fp64; fp16, like bf16, goes to the tensor cores in the same tiles).
SERVING = Serving(backend="triton", check_device=check_device)

# Triton specialises a pointer on 16-byte alignment (and an int on == 1 and % 16), and a
# load's layout follows: a different binary, and for a reduction a different order.
ALIGN_BYTES = 16


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` (rows, cols) contiguous, 16-byte aligned, and with row stride == cols even for one row.

    A 1-row view of a wider buffer is "contiguous" with the wide buffer's stride, and a
    row-offset slice may start off a 16-byte boundary: either would give the kernel
    another specialisation than the batched call. The stride of a single row is never
    used to reach another row, so it is restated; a misaligned start is copied.
    """
    t = t.contiguous()
    if t.dim() == 2 and t.shape[0] == 1 and t.stride(0) != t.shape[1]:
        t = t.as_strided(t.shape, (t.shape[1], 1))
    if t.data_ptr() % ALIGN_BYTES:
        t = t.clone()
    return t


@triton.jit
def div_rn(a, b, ACC: tl.constexpr):
    """a / b rounded to nearest (IEEE, as torch divides): fp32 `/` compiles to the 2-ulp
    `div.full.f32`; fp64 `/` is already `div.rn.f64`."""
    if ACC == tl.float32:
        return tl.div_rn(a, b)
    else:
        return a / b


@triton.jit
def sqrt_rn(x, ACC: tl.constexpr):
    """sqrt(x) rounded to nearest: fp32 `tl.sqrt` compiles to `sqrt.approx.ftz.f32`."""
    if ACC == tl.float32:
        return tl.sqrt_rn(x)
    else:
        return tl.sqrt(x)
