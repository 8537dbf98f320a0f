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

fp64 and fp16 (gradcheck, rare) go through a padded, K-sliced torch GEMM
(`_torch_gemm.py`: native's GEMM before issue 15, kept so these bits do not change).
Backward is the native one: plain GEMMs, accurate and deterministic; gradients
are summed over the batch, so they need not be batch-invariant.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32, check_projection
from rl_engine.kernels.common.linear import invariant_linear_function, project
from rl_engine.kernels.cpp._extension import current_isa, extension
from rl_engine.kernels.cpp._torch_gemm import padded_sliced_matmul

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_operands(x2d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return x2d, weight


def _on_kernel(x2d: torch.Tensor) -> bool:
    return x2d.dtype in KERNEL_DTYPES and x2d.device.type == "cpu"


def fixed_order_gemm(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> fp32 (M, N); fp64 stays fp64."""
    if not _on_kernel(x2d):
        return padded_sliced_matmul(x2d, weight, out_dtype=at_least_fp32(x2d.dtype))
    x2d, weight = _kernel_operands(x2d, weight)
    return extension().gemm(x2d, weight, current_isa())


def linear_forward(x2d, weight, bias, out_dtype):
    """fp32 GEMM -> out_dtype, then + bias in out_dtype; fused in the kernel for fp32 / bf16 out."""
    if _on_kernel(x2d) and out_dtype in KERNEL_DTYPES:
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


_InvariantLinear = invariant_linear_function(linear_forward, __name__)


def _apply(x, weight, bias, out_dtype):
    tracked = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and tracked:
        return project(_InvariantLinear, x, weight, bias, out_dtype)
    # Inference (rollout decode): the same forward, without the autograd.Function cost.
    check_projection("x", x, weight, bias)
    out = linear_forward(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> (..., N) in x.dtype."""
    return _apply(x, weight, bias, x.dtype)


def lm_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Vocabulary projection: hidden (..., H), weight (V, H) -> fp32 logits (..., V) (fp64 for fp64).

    The same kernel as `linear`, without the final rounding to bf16.
    """
    return _apply(hidden, weight, bias, at_least_fp32(hidden.dtype))
