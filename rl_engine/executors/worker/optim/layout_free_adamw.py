"""AdamW whose update of an element depends on nothing but that element: not its position in a
flat buffer, not the buffer's length, not how ZeRO cut the parameters into partitions.

torch's AdamW runs fused elementwise kernels (`lerp_`, `addcmul_`, `addcdiv_`, `add_` with
`alpha`): their SIMD body and their scalar tail may contract a multiply and an add into one FMA
differently, so an element's bits can depend on where the partition boundary put it. Here every
pass is one IEEE operation per element (`mul`, `add`, `sub`, `div`, `sqrt`), correctly rounded on
either path, so the same element gets the same bits whatever the partition. The update is
AdamW's (decoupled weight decay, bias-corrected moments); the state keys are torch's
(`exp_avg`, `exp_avg_sq`, `step`), so DeepSpeed's fragment accessors read and write them.

It updates only when armed: `arm(grad_scale)` before the engine's step hands it one update
(`grad_scale`, the layout-free clip coefficient or None, multiplies each gradient element
first; DeepSpeed's own clipping is off in this mode). Unarmed, `step` only creates the state:
DeepSpeed's bf16 ZeRO-0 optimizer calls `step` once at construction with zero gradients to
initialise it, which under AdamW would decay the weights and count a step that the other
stages never take.
"""

from __future__ import annotations

import math

import torch

# elements per pass: bounds the temporaries of one pass (4 MiB fp32) without changing a bit
CHUNK = 1 << 20


class LayoutFreeAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay=0.0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"LayoutFreeAdamW: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay} "
                "out of range"
            )
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self._armed, self._grad_scale = False, None

    def arm(self, grad_scale: float | None) -> None:
        """The next `step` updates, each gradient element first multiplied by `grad_scale`."""
        self._armed, self._grad_scale = True, grad_scale

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LayoutFreeAdamW.step takes no closure")
        armed, self._armed = self._armed, False
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._initialised(param)
                    if armed:
                        self._update(param, group)
        return None

    def _initialised(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        state["step"] += 1
        scalars = _Scalars.of(group, int(state["step"].item()), self._grad_scale)
        flat = [t.view(-1) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
        for start in range(0, flat[0].numel(), CHUNK):
            chunk = [t[start : start + CHUNK] for t in flat]
            _adamw_chunk(*chunk, scalars)


class _Scalars:
    """The step's Python scalars, computed in double as torch's AdamW does."""

    def __init__(self, lr, beta1, beta2, eps, decay, bias1, bias2_sqrt, grad_scale):
        self.lr, self.beta1, self.beta2, self.eps, self.decay = lr, beta1, beta2, eps, decay
        self.step_size, self.bias2_sqrt, self.grad_scale = lr / bias1, bias2_sqrt, grad_scale

    @classmethod
    def of(cls, group: dict, step: int, grad_scale: float | None) -> _Scalars:
        beta1, beta2 = group["betas"]
        return cls(
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            1.0 - beta1**step,
            math.sqrt(1.0 - beta2**step),
            grad_scale,
        )


def _adamw_chunk(param, grad, exp_avg, exp_avg_sq, s: _Scalars) -> None:
    """One chunk's update, one correctly rounded operation per pass."""
    grad = grad.to(param.dtype)
    if s.grad_scale is not None:
        grad = grad * s.grad_scale
    if s.decay != 0.0:
        param.mul_(1.0 - s.lr * s.decay)
    exp_avg.mul_(s.beta1)
    exp_avg.add_(grad * (1.0 - s.beta1))
    square = grad * grad
    square.mul_(1.0 - s.beta2)
    exp_avg_sq.mul_(s.beta2)
    exp_avg_sq.add_(square)
    denom = exp_avg_sq.sqrt()
    denom.div_(s.bias2_sqrt)
    denom.add_(s.eps)
    update = exp_avg / denom
    update.mul_(s.step_size)
    param.sub_(update)
