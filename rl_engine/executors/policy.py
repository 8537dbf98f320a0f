"""What DeepSpeed wraps and steps: the logprob module and the guard on the optimizer step.

Logprobs never go through full logits: `LogprobModule` (the module handed to
`deepspeed.initialize`) runs the Hugging Face decoder to its final hidden states
and scores them with `rl_engine.logprobs.score_targets` on the LM-head weight.
That weight is used outside the LM-head module's own forward, so under ZeRO-3 it
is registered as an external parameter of the wrapper
(`deepspeed.zero.register_external_parameter`): DeepSpeed gathers it for the
wrapper's forward and backward.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.executors.distributed import Collectives
from rl_engine.logprobs import score_targets
from rl_engine.patching import lm_head_parameters


class LogprobModule(nn.Module):
    """HF decoder -> final hidden states -> fused `linear_logp` on the LM-head weight."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def head_parameters(self) -> tuple[nn.Parameter, nn.Parameter | None]:
        """(weight (V, H), bias (V,) or None) of the policy's vocabulary projection."""
        return lm_head_parameters(self.policy)

    def forward(self, input_ids, attention_mask, targets, temperature: float) -> torch.Tensor:
        """input_ids/attention_mask (B, T), targets (B, T-1) -> fp32 logprobs (B, T-1), 0 at IGNORE_INDEX."""
        return score_targets(
            self.policy, input_ids, attention_mask, targets, temperature=temperature
        )


class StepGuard:
    """Wraps the torch optimizer's `step` so that an update is applied on all ranks or on none.

    DeepSpeed calls the torch optimizer's step on every rank at the accumulation boundary
    (on the fp32 master partitions under ZeRO), unless it skipped the step itself (ZeRO-3,
    fp32 ZeRO-1/2 and the bf16 optimizer skip on a non-finite gradient norm; plain fp32
    and bf16 ZeRO-1/2 do not). The guard checks this rank's gradients, ORs the flag with
    `force_skip` (set by the worker for a non-finite loss) and all-reduces it: if any rank
    objects, no rank calls the real step, so weights and optimizer state stay untouched.
    `outcome` is 'stepped', 'skipped', or None when DeepSpeed never called the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Collectives):
        self.optimizer, self.comm = optimizer, comm
        self._step = optimizer.step
        optimizer.step = self._guarded_step  # instance attribute: DeepSpeed calls optimizer.step()
        self.force_skip, self.outcome = False, None

    def arm(self, force_skip: bool) -> None:
        self.force_skip, self.outcome = force_skip, None

    @torch.no_grad()
    def _guarded_step(self, *args, **kwargs):
        grads = [
            p.grad
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        bad = self.force_skip or any(not bool(torch.isfinite(g).all()) for g in grads)
        if self.comm.any(bad):
            self.outcome = "skipped"
            return None
        self.outcome = "stepped"
        return self._step(*args, **kwargs)


def release_zero3_parameters(engine) -> None:
    """After an exception inside a ZeRO-3 forward/backward: release every gathered parameter."""
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    coordinator.release_and_reset_all(engine.module)
