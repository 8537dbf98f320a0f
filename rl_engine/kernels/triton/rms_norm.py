"""RMSNorm on the GPU with Hugging Face semantics: fp32 statistics, normalised value cast back, then * weight.

One program per row. The sum of squares runs over the row in chunks of BLOCK
columns from column 0, into a BLOCK-wide fp32 vector, reduced once at the end:
the order depends only on the row length. Backward: grad x by a kernel of the
same shape (one program a row, the forward's rstd and chunk order: row-invariant,
so the layout-invariant mode's input gradient, common/rms_norm.py); the weight's
plain gradient by autograd through the formula in plain torch (deterministic; in
the layout-invariant mode the shared per-sequence row sums instead).

One binary for every call: no pointer or integer argument is specialised, so
the loads' layout (which elements each thread sums) is the same for every row
count, offset and view. Rounding on a GPU: the mean is an IEEE division and
rstd = 1 / sqrt(mean + eps) is a correctly rounded square root and division
(`sqrt_rn`, `div_rn`): where HF's `torch.rsqrt` rounds once (its CUDA rsqrt is
an approximation itself), this rounds twice, so rstd may differ from torch's by
an ulp (tests/gpu: within 1 bf16 ulp of the fp64 formula). fp64 inputs: eps
arrives as an fp32 scalar (Triton passes Python floats as fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.rms_norm import rms_norm_op
from rl_engine.kernels.triton._common import SERVING, div_rn, sqrt_rn, tl_dtype
from rl_engine.kernels.triton._launch import FP_FUSION, Launch

_MAX_BLOCK = 4096  # chunk width: next power of two of H, at most this (depends on H only)


_ARGS = ["x_ptr", "w_ptr", "out_ptr", "H", "stride_x", "stride_o"]


@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=ACC)
    for h0 in range(0, H, BLOCK):
        x = tl.load(x_ptr + row * stride_x + h0 + offs, mask=h0 + offs < H, other=0.0).to(ACC)
        sq += x * x
    mean = div_rn(tl.sum(sq, axis=0), H.to(ACC), ACC)
    rstd = div_rn(tl.full((), 1.0, ACC), sqrt_rn(mean + eps, ACC), ACC)
    for h0 in range(0, H, BLOCK):
        mask = h0 + offs < H
        x = tl.load(x_ptr + row * stride_x + h0 + offs, mask=mask, other=0.0)
        w = tl.load(w_ptr + h0 + offs, mask=mask, other=0.0)
        normed = (x.to(ACC) * rstd).to(x.dtype)  # cast back to the input dtype, as HF does
        y = w.to(ACC) * normed.to(ACC)
        tl.store(out_ptr + row * stride_o + h0 + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


_BACKWARD_ARGS = ["x_ptr", "w_ptr", "dy_ptr", "dx_ptr", "H", "stride_x", "stride_dy", "stride_dx"]


@triton.jit(do_not_specialize=_BACKWARD_ARGS, do_not_specialize_on_alignment=_BACKWARD_ARGS)
def _rms_norm_backward_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    H,
    stride_x,
    stride_dy,
    stride_dx,
    eps,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dx of one row: the forward's rstd (same chunks and roundings), g = dy * w rounded to
    x's dtype (the plain backward's gradient of the cast normed value), then
    dx = g * rstd - x * (rstd^3 * sum(g * x) / H), the sum in the forward's chunk order."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=ACC)
    gx = tl.zeros((BLOCK,), dtype=ACC)
    for h0 in range(0, H, BLOCK):
        mask = h0 + offs < H
        x_raw = tl.load(x_ptr + row * stride_x + h0 + offs, mask=mask, other=0.0)
        x = x_raw.to(ACC)
        w = tl.load(w_ptr + h0 + offs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + row * stride_dy + h0 + offs, mask=mask, other=0.0).to(ACC)
        g = (dy * w).to(x_raw.dtype).to(ACC)
        sq += x * x
        gx += g * x
    mean = div_rn(tl.sum(sq, axis=0), H.to(ACC), ACC)
    rstd = div_rn(tl.full((), 1.0, ACC), sqrt_rn(mean + eps, ACC), ACC)
    coef = div_rn(rstd * rstd * rstd * tl.sum(gx, axis=0), H.to(ACC), ACC)
    for h0 in range(0, H, BLOCK):
        mask = h0 + offs < H
        x_raw = tl.load(x_ptr + row * stride_x + h0 + offs, mask=mask, other=0.0)
        x = x_raw.to(ACC)
        w = tl.load(w_ptr + h0 + offs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + row * stride_dy + h0 + offs, mask=mask, other=0.0).to(ACC)
        g = (dy * w).to(x_raw.dtype).to(ACC)
        dx = g * rstd - x * coef
        tl.store(dx_ptr + row * stride_dx + h0 + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(
    x2d: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> Launch:
    """The launch that writes out (M, H) = rms_norm(x2d) * weight, one program a row."""
    M, H = x2d.shape
    block = min(triton.next_power_of_2(H), _MAX_BLOCK)
    return Launch(
        variant=f"rms_norm_block{block}",
        kernel=_rms_norm_kernel,
        grid=(M,),
        args=(x2d, weight, out, H, x2d.stride(0), out.stride(0), float(eps)),
        constexprs=dict(ACC=tl_dtype(at_least_fp32(x2d.dtype)), BLOCK=block),
        num_warps=4 if H <= 4096 else 8,  # from H alone (a model constant): part of the numerics
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


def rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2d = x2d.contiguous()
    M, H = x2d.shape
    out = torch.empty((M, H), dtype=torch.promote_types(weight.dtype, x2d.dtype), device=x2d.device)
    if M == 0:
        return out
    rms_norm_launch(x2d, weight.contiguous(), out, eps).run()
    return out


def rms_norm_backward_launch(x2d, weight, grad_out, grad_x, eps: float) -> Launch:
    """The launch that writes grad_x (M, H) from grad_out (M, H), one program a row (the
    forward's chunk width and num_warps: its reduction order)."""
    M, H = x2d.shape
    block = min(triton.next_power_of_2(H), _MAX_BLOCK)
    return Launch(
        variant=f"rms_norm_backward_block{block}",
        kernel=_rms_norm_backward_kernel,
        grid=(M,),
        args=(
            x2d,
            weight,
            grad_out,
            grad_x,
            H,
            x2d.stride(0),
            grad_out.stride(0),
            grad_x.stride(0),
            float(eps),
        ),
        constexprs=dict(ACC=tl_dtype(at_least_fp32(x2d.dtype)), BLOCK=block),
        num_warps=4 if H <= 4096 else 8,
        num_stages=1,
        fp_fusion=FP_FUSION,
    )


def rms_norm_grad_x(x2d, weight, grad_out, eps: float) -> torch.Tensor:
    """d loss / d x (M, H) in x's dtype, each row from its own row alone (the kernel)."""
    x2d, grad_out = x2d.contiguous(), grad_out.contiguous()
    grad_x = torch.empty_like(x2d)
    if x2d.shape[0]:
        rms_norm_backward_launch(x2d, weight.contiguous(), grad_out, grad_x, eps).run()
    return grad_x


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same formula in plain torch (for the backward)."""
    x32 = x.to(at_least_fp32(x.dtype))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class _InvariantRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        ctx.save_for_backward(x2d, weight)
        ctx.eps = eps
        return rms_norm_forward(x2d, weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = rms_norm_grad_x(x2d, weight, grad_out, ctx.eps)
        if ctx.needs_input_grad[1]:
            with torch.enable_grad():
                w = weight.detach().requires_grad_(True)
                y = rms_norm_reference(x2d.detach(), w, ctx.eps)
                (grad_w,) = torch.autograd.grad(y, w, grad_out)
        return grad_x, grad_w, None


def apply_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) -> (..., H) in promote(x.dtype, weight.dtype), rows through the kernel."""
    out = _InvariantRMSNorm.apply(x.reshape(-1, x.shape[-1]), weight, float(eps))
    return out.reshape(x.shape)


rms_norm = rms_norm_op(apply_rms_norm, SERVING, __name__)
