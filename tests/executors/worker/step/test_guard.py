"""StepGuard on a plain torch AdamW (one rank): finite gradients step; a non-finite gradient
or a forced skip leaves the weights and the optimizer state untouched, bit for bit, and says so
in `outcome` (None until the step is called)."""

from __future__ import annotations

import torch

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.step.guard import StepGuard


def guarded(grad: torch.Tensor) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, StepGuard]:
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    guard = StepGuard(optimizer, Collectives(0, 1, torch.device("cpu")))
    weight.grad = grad
    return weight, optimizer, guard


def test_finite_gradients_step():
    weight, optimizer, guard = guarded(torch.tensor([0.5, 0.5, 0.5]))
    before = weight.detach().clone()
    guard.arm(force_skip=False)
    assert guard.outcome is None
    optimizer.step()
    assert guard.outcome == "stepped"
    assert not torch.equal(weight.detach(), before) and optimizer.state[weight]["step"] == 1


def test_a_non_finite_gradient_or_a_forced_skip_changes_nothing():
    for grad, force in [
        (torch.tensor([0.5, float("nan"), 0.5]), False),
        (torch.tensor([0.5] * 3), True),
    ]:
        weight, optimizer, guard = guarded(grad)
        before = weight.detach().clone()
        guard.arm(force_skip=force)
        assert optimizer.step() is None
        assert guard.outcome == "skipped"
        assert torch.equal(weight.detach(), before) and len(optimizer.state) == 0
