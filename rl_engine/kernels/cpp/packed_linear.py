"""A weight packed once into the GEMM's panels, and the projection that reads it.

The C++ GEMM (csrc/gemm_impl.h) reads the weight as panels of 64 columns, K-major
(bf16: VNNI pairs). `extension().gemm` transposes each block of the weight into a
panel on every call; at decode sizes that transpose, and the 64 strided row streams
it reads, cost more than the product (SmolLM2-135M bf16, batch 8, cold weights: the
step's GEMMs 39 ms packing per call, 15 ms on panels packed once; docs/benchmarks.md).
`pack_weight` makes those panels once; `packed_projection` runs the kernel on them.

Bits: packing is layout only. The panels hold the weight's values, and the kernel runs
the same serial K chain per output on them (the one every M runs), so the result is
`torch.equal` to `linear` / `lm_head` on the weight (tests/kernels/cpp/test_packed_linear.py).

Staleness is the caller's: a PackedWeight is a copy, and a later change to the weight
is not seen until it is packed again (`pack_weight(weight, into=old)` repacks in place).
Forward only: the projection refuses an input that wants a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp._serving import KERNEL_DTYPES, check_device


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """The panels of one (out_features, in_features) weight, as `gemm_pack` lays them out."""

    data: torch.Tensor  # 1-D, the weight's dtype
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def packs(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` takes this weight: 2-D, on cpu, fp32 or bf16 (the kernel's dtypes)."""
    return weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in KERNEL_DTYPES


def pack_weight(weight: torch.Tensor, into: PackedWeight | None = None) -> PackedWeight:
    """`weight` (N, K) packed into panels; into `into`'s buffer when given (same shape and
    dtype, else ValueError), so that repacking a changed weight allocates nothing."""
    if not packs(weight):
        raise ValueError(
            f"pack_weight takes a 2-D float32 / bfloat16 cpu weight, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    out_features, in_features = weight.shape
    if into is not None and (into.out_features, into.in_features, into.dtype) != (
        out_features,
        in_features,
        weight.dtype,
    ):
        raise ValueError(
            f"cannot repack a {tuple(weight.shape)} {weight.dtype} weight into the buffer of a "
            f"({into.out_features}, {into.in_features}) {into.dtype} one"
        )
    w = weight.detach()
    if w.stride(-1) != 1:
        w = w.contiguous()
    data = extension().gemm_pack(w, current_isa(), None if into is None else into.data)
    return PackedWeight(data, out_features, in_features)


def packed_projection(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (..., K) @ weight^T + bias -> (..., N) in `out_dtype` (x.dtype when None; fp32 is
    `lm_head`'s): the bits of the cpp `linear` (x.dtype out) / `lm_head` (fp32 out)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_device("x", x)
    if x.dtype != packed.dtype or out_dtype not in (x.dtype, at_least_fp32(x.dtype)):
        raise ValueError(
            f"x is {x.dtype} (out {out_dtype}) but the packed weight is {packed.dtype}"
        )
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x has K={x.shape[-1]} but the packed weight has K={packed.in_features}")
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        raise RuntimeError("packed_projection is forward only; x or bias wants a gradient")
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if bias is not None:
        bias = bias.detach().to(out_dtype).contiguous()
    out = extension().gemm_packed(
        x2d, packed.data, packed.out_features, current_isa(), bias, out_dtype == torch.bfloat16
    )
    return out.reshape(*x.shape[:-1], packed.out_features)
