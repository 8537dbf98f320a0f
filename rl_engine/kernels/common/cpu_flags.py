"""The CPU's instruction-set flags, read once per process from /proc/cpuinfo.

Kernels consult them for speed only where the choice cannot change a forward's
bits (the backward GEMMs' compute dtype, a reduction slice width fixed per
machine); every forward bit is fixed by the backend and its numerics version.
"""

from __future__ import annotations

from functools import cache

import torch

# Instructions that give 16-bit floating-point GEMMs a native path (oneDNN / MKL use them).
_BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of the first processor in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def slow_16bit_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """True where torch's `dtype` GEMM on `device` has no native instructions: bf16 / fp16 on
    a CPU without AVX512-BF16 or AMX-BF16, where it runs a reference loop about 15-50x slower
    than the fp32 GEMM of the same shape (docs/platform-facts.md)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return not any(flag in cpu_flags() for flag in _BF16_MATMUL_FLAGS)


def backward_mm(
    a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """a @ b for a plain backward, in a's dtype (into `out` when given). Where that dtype's GEMM
    is slow on this CPU (`slow_16bit_matmul`), the product runs in fp32 and is rounded once: the
    accuracy of a native bf16 GEMM (fp32 accumulation, one rounding), at the fp32 GEMM's speed.
    Gradients need no batch invariance, so this choice per machine never touches a logprob's bits."""
    if not slow_16bit_matmul(a.dtype, a.device):
        return torch.mm(a, b, out=out)
    product = torch.mm(a.float(), b.float())
    return product.to(a.dtype) if out is None else out.copy_(product)
