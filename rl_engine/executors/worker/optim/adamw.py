"""The trainer's optimizer: torch AdamW, its update applied a block of elements at a time.

On CPU tensors torch's AdamW runs its single-tensor update, whose denominator
`(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` makes two temporaries the size
of the whole parameter. Under ZeRO the parameter it steps is a sub-group's flat fp32
partition, and a sub-group holds whole parameters: on the Qwen2.5-0.5B shape the tied
embedding's partition alone is 68 M elements a rank, so the update took 2 x 272 MB
beside the model states at the optimizer step. `adamw` runs the same update (torch's own
functional `adam`, in decoupled-weight-decay mode, every op elementwise) on consecutive
blocks of at most `ADAM_BLOCK_ELEMENTS` elements of each parameter, each block from the
step count before the update: the same bits as the update of the whole tensor, with
temporaries of one block.

DeepSpeed accepts a client optimizer by its exact type (`torch.optim.AdamW`, without
`zero_allow_untested_optimizer`), so the blockwise step is set on the instance, as
`step.guard.StepGuard` sets its guard on top of it.
"""

from __future__ import annotations

import functools

import torch
from torch.optim.adam import adam

# Elements per block of the update: fp32 temporaries of 16 MiB, and a multiple of every
# SIMD width, so a block's vectorised loop and its scalar tail cover the same elements as
# over the whole tensor (the bits are equal either way: each op is elementwise).
ADAM_BLOCK_ELEMENTS = 1 << 22


def adamw(params: list[torch.Tensor], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch AdamW over `params` (its defaults otherwise); on the CPU, stepping in blocks of
    elements. Elsewhere torch picks its multi-tensor or fused update, left as it is."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if all(p.device.type == "cpu" for p in params):
        optimizer.step = functools.partial(_step_in_blocks, optimizer)
    return optimizer


@torch.no_grad()
def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` is finite, checked a block at a time: `torch.isfinite`
    of a whole tensor makes its `abs()` and three bool tensors of its size (476 MB for the
    0.5B shape's embedding partition, at the step's peak)."""
    flat = tensor.reshape(-1)  # a ZeRO gradient is flat and contiguous: no copy
    return all(
        bool(torch.isfinite(flat[start : start + ADAM_BLOCK_ELEMENTS]).all())
        for start in range(0, flat.numel(), ADAM_BLOCK_ELEMENTS)
    )


@torch.no_grad()
def _step_in_blocks(optimizer: torch.optim.AdamW, closure=None):
    if closure is not None:
        raise ValueError("the blockwise AdamW step takes no closure")
    for group in optimizer.param_groups:
        _check_group(group)
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
        if has_complex:
            raise ValueError("the blockwise AdamW step does not take complex parameters")
        for tensors in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            _update(group, *tensors)
    return None


def _check_group(group: dict) -> None:
    """The options `_update` implements: torch's plain decoupled AdamW, nothing else."""
    unsupported = {
        key: group[key]
        for key in ("amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach")
        if group.get(key)  # foreach / fused None: torch picks the single-tensor update on CPU
    }
    if unsupported or not group.get("decoupled_weight_decay", False):
        raise ValueError(f"the blockwise AdamW step does not implement {unsupported or group}")


def _update(group: dict, param, grad, exp_avg, exp_avg_sq, step: torch.Tensor) -> None:
    """One AdamW update of `param`, block by block; `step` counts it once."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors):  # a flat view would be a copy
        _adamw_update(group, *tensors, step)
        return
    flat = [t.view(-1) for t in tensors]
    before = step.clone()
    for start in range(0, max(param.numel(), 1), ADAM_BLOCK_ELEMENTS):
        step.copy_(before)  # torch's update adds 1 to the count it is given
        blocks = (t[start : start + ADAM_BLOCK_ELEMENTS] for t in flat)
        _adamw_update(group, *blocks, step)


def _adamw_update(group: dict, param, grad, exp_avg, exp_avg_sq, step: torch.Tensor) -> None:
    """torch's single-tensor AdamW update of one tensor (what `AdamW.step` runs on CPU)."""
    adam(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        foreach=False,
        fused=False,
        capturable=False,
        differentiable=False,
        has_complex=False,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=group["betas"][0],
        beta2=group["betas"][1],
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
