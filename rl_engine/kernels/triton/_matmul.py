"""Persistent fixed-order matmul: the Triton GEMM behind `linear`, `lm_head`, `linear_logp` and their backward.

out (M, N) = x (M, K) @ w (N, K)^T (+ bias), accumulated in fp32 (fp64 for fp64).

A row's bits are fixed by construction:
- the tile sizes are constants (never chosen from M), so the same compiled
  kernel serves M = 1 and M = 8192 (`M`, `N` and the output's row stride are
  excluded from Triton's integer specialisation, which would compile a separate
  kernel for M == 1 or for a vocabulary not divisible by 16; the activations
  are passed 16-byte aligned with their row stride restated for one row,
  `aligned_rows`, so slices and 1-row views get the batched call's binary);
- each output tile walks K from column 0 in steps of BLOCK_K, one `tl.dot`
  per step into the same fp32 accumulator: no split-K, no atomics;
- rows of a tile never mix (a dot's output row only reads its own input row),
  and masked rows / columns load as 0.
The launch is persistent (one program per SM, looping over tiles): which
program computes a tile changes with M, what it computes does not.

One body (`_matmul_tiles`), two kernels: `_matmul_kernel`, the forward's (K and
the input strides specialised: model widths), and `_exact_gemm_kernel`, the
layout-invariant backward's `exact_gemm` (no bias, fp32 out, nothing specialised:
its K is a sequence's length when it sums a weight partial over the sequence's rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.triton._common import (
    INTERPRET,
    aligned_rows,
    num_programs,
    tl_dtype,
    upcast_dot,
)
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

# Part of the numerics (BLOCK_K sets the reduction order); the same for every M.
# The interpreter (tests on CPU) uses smaller tiles: its dot is a slow numpy loop
# whose cost grows with the padded tile, and its numerics are its own anyway.
BLOCK_M, BLOCK_N, BLOCK_K = (16, 128, 64) if INTERPRET else (128, 128, 64)
_NUM_WARPS = 8
# By element size: pipelining never changes the bits; these keep the shared memory
# under every target's limit (sm_86/89: 99 KB), which the compile check verifies.
_NUM_STAGES = {2: 3, 4: 1, 8: 1}


@triton.jit
def _matmul_tiles(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    programs,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """This program's output tiles of x (M, K) @ w (N, K)^T (+ bias): the body of both kernels."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for tile in range(pid, tiles_m * tiles_n, programs):
        # consecutive programs share a weight column block (L2 reuse); order never changes bits
        tm = tile % tiles_m
        tn = tile // tiles_m
        rm = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )  # (BM, BK)
            b = tl.load(
                w_ptr + rn[None, :] * stride_wn + kk[:, None],
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )  # (BK, BN)
            if UPCAST:  # fp32 / fp64 operands, or any under the interpreter: no TF32
                acc = tl.dot(a.to(ACC), b.to(ACC), acc, input_precision="ieee")
            else:  # bf16 / fp16 tiles straight to the tensor cores
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
            acc = acc + bias.to(ACC)[None, :]
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


_ARGS = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_wn"]
_ARGS += ["stride_om", "programs"]


@triton.jit(do_not_specialize=["M", "N", "stride_om", "programs"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    programs,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The forward's projection: K (a model width) and the strides are specialised."""
    _matmul_tiles(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, programs,
        HAS_BIAS, ACC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


# nothing specialised: K is a sequence's length in a weight partial, and every length,
# row count and view runs one binary (the compile check's groups `exact_gemm_<operand dtype>`)
@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _exact_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    programs,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The layout-invariant backward's GEMM: the forward's tiles and K order, no bias."""
    _matmul_tiles(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, programs,
        False, ACC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


def matmul_launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> Launch:
    """The launch that writes out (M, N) = x (M, K) @ weight (N, K)^T + bias (operands as given)."""
    M, K = x.shape
    N = weight.shape[0]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    programs = num_programs(x.device, tiles)
    return Launch(
        variant="matmul_bias" if bias is not None else "matmul",
        kernel=_matmul_kernel,
        grid=(programs,),
        args=(
            x,
            weight,
            bias if bias is not None else x,
            out,
            M,
            N,
            K,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            programs,
        ),
        constexprs=dict(
            HAS_BIAS=bias is not None,
            ACC=tl_dtype(acc),
            UPCAST=upcast_dot(x.dtype),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        ),
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES[x.element_size()],
        fp_fusion=FP_FUSION,
    )


def fixed_order_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, out_dtype: torch.dtype
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias -> (M, N) in `out_dtype`, row-invariant (fp32 sums)."""
    x = aligned_rows(x)
    weight = aligned_rows(weight)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        return out if bias is None else out.add_(bias.to(out_dtype))
    if bias is not None:
        bias = aligned_rows(bias.reshape(1, -1)).reshape(-1)
    matmul_launch(x, weight, bias, out).run()
    return out


def exact_gemm_launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Launch:
    """The launch that writes out (M, N) = a (M, K) @ b (N, K)^T, fp32 (fp64) accumulation."""
    M, K = a.shape
    N = b.shape[0]
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    programs = num_programs(a.device, tiles)
    return Launch(
        variant="exact_gemm_" + str(a.dtype).removeprefix("torch."),  # one binary each
        kernel=_exact_gemm_kernel,
        grid=(programs,),
        args=(a, b, a, out, M, N, K, a.stride(0), b.stride(0), out.stride(0), programs),
        constexprs=dict(
            ACC=tl_dtype(out.dtype),
            UPCAST=upcast_dot(a.dtype),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        ),
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES[a.element_size()],
        fp_fusion=FP_FUSION,
    )


def exact_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The layout-invariant backward's GEMM (common/sequence_grads.py, `ExactGemm`): a (M, K)
    @ b (N, K)^T -> fp32 (M, N) (fp64 for fp64), operands as given (the parameter's dtype).

    Output row m is one fixed chain over K whatever M, a's other rows, its alignment or the
    program count: the forward's constant tiles, K walked from column 0 in BLOCK_K steps,
    one `tl.dot` per step into the fp32 accumulator (bf16 / fp16 tiles on the tensor cores,
    products exact; fp32 / fp64 `ieee`), no split-K, no atomics; and one binary for every
    M, N, K and view (`_exact_gemm_kernel` specialises nothing)."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    M, K, N = a.shape[0], a.shape[1], b.shape[0]
    out = torch.empty((M, N), dtype=acc, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:  # the empty chain
        return out.zero_()
    exact_gemm_launch(aligned_rows(a), aligned_rows(b), out).run()
    return out
