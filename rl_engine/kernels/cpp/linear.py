"""Batch-invariant linear layer on CPU through the fixed-order C++ GEMM.

Every output element y[m, n] is one serial chain over K computed by one code
path (csrc/gemm_impl.h, "serial K chain"): fp32 acc = +0, then acc =
fma(x[m, k], w[n, k], acc) for k = 0 .. K-1 in increasing order; bf16 by
pairs in increasing order, odd element first (VDPBF16PS), accumulated in fp32.
Blocking, packing and threads only split output blocks (and store / reload
the exact fp32 accumulator between K blocks), so a row has the same bits for
M = 1 (decode) and M = 4096 (training), at any row position, next to any
rows, with any thread count, and without padding small batches. bf16
products are exact and summed in fp32: the result is rounded once, at the end
(to bf16 for `linear`, kept in fp32 for `lm_head`). The rounding and the bias
are fused into the kernel (each output tile is finished after its last K
block) with the bits of the unfused steps: `y.to(out_dtype) + bias.to(out_dtype)`
(for bf16: round to nearest even, then the bias added in fp32 and rounded again).

fp64 and fp16 are not served: they would go through a padded, K-sliced torch
GEMM (`_torch_gemm.py`) that is not row-invariant, so the ops raise
NonInvariantDtypeError for them unless the caller opts in
(`get_op(..., allow_non_invariant=True)`, e.g. gradcheck in fp64).
Backward, the autograd.Function and the ops' checks are the shared ones
(rl_engine/kernels/common/linear.py): plain GEMMs, accurate and deterministic;
gradients are summed over the batch, so they need not be batch-invariant. The
layout-invariant mode (`spans=`, `sink=`) runs its backward through `exact_gemm`, these
kernels in the parameter's dtype, so a sequence's weight partial and a token's input
gradient are chains fixed by the sequence / the row alone.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.linear import linear_op, lm_head_op, projection
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp._serving import GEMM, KERNEL_DTYPES
from rl_engine.kernels.cpp._torch_gemm import padded_sliced_matmul


def _kernel_operands(x2d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return x2d, weight


def fixed_order_gemm(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> fp32 (M, N); fp64 stays fp64 (the opt-in torch GEMM)."""
    if x2d.dtype not in KERNEL_DTYPES:
        return padded_sliced_matmul(x2d, weight, out_dtype=at_least_fp32(x2d.dtype))
    x2d, weight = _kernel_operands(x2d, weight)
    return extension().gemm(x2d, weight, current_isa())


def linear_forward(x2d, weight, bias, out_dtype):
    """fp32 GEMM -> out_dtype, then + bias in out_dtype; fused in the kernel for fp32 / bf16 out."""
    if x2d.dtype in KERNEL_DTYPES and out_dtype in KERNEL_DTYPES:
        x2d, weight = _kernel_operands(x2d, weight)
        if bias is not None:
            bias = bias.to(out_dtype).contiguous()
        return extension().gemm(
            x2d, weight, current_isa(), bias, out_bf16=out_dtype == torch.bfloat16
        )
    out = fixed_order_gemm(x2d, weight).to(out_dtype)  # (M, N)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def exact_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The layout-invariant backward's GEMM (common/sequence_grads.py, `ExactGemm`): a (M, K)
    @ b (N, K)^T -> fp32 (M, N), each output one chain over K of this backend's kernel: fp32
    operands the serial K chain, bf16 operands the pair chain of `cpp_bf16_dot` (the
    forward's numerics, fp32 accumulation). Threads split outputs only. (fp64, opted in
    only: the torch GEMM, not row-invariant.)"""
    return fixed_order_gemm(a, b)


PROJECTION = projection(linear_forward, __name__, exact_gemm)
linear = linear_op(PROJECTION, GEMM, __name__)
lm_head = lm_head_op(PROJECTION, GEMM, __name__)
