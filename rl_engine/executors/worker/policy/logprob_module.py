"""What DeepSpeed wraps for the policy: its logprob module.

Logprobs never go through full logits: `LogprobModule` (the module handed to
`deepspeed.initialize`) runs the Hugging Face decoder to its final hidden states
and scores them with `rl_engine.logprobs.score_targets` (padded micro-batches) or
`packed_score_targets` (packed rows) on the LM-head weight.
That weight is used outside the LM-head module's own forward, so under ZeRO-3 it
is registered as an external parameter of the wrapper
(`deepspeed.zero.register_external_parameter`): DeepSpeed gathers it for the
wrapper's forward and backward. A weight the head shares with the input embedding gets
its gradient once, at the end of the backward (`tied_gradient`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.policy.tied_gradient import tied_head_gradient
from rl_engine.logprobs import IGNORE_INDEX, packed_score_targets, score_targets
from rl_engine.patching import lm_head_parameters


class LogprobModule(nn.Module):
    """HF decoder -> final hidden states -> fused `linear_logp` on the LM-head weight."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def head_parameters(self) -> tuple[nn.Parameter, nn.Parameter | None]:
        """(weight (V, H), bias (V,) or None) of the policy's vocabulary projection."""
        return lm_head_parameters(self.policy)

    def forward(
        self, input_ids, attention_mask, targets, temperature: float, positions=None, segments=None
    ) -> torch.Tensor:
        """Padded: input_ids/attention_mask (B, T), targets (B, T-1) -> fp32 logprobs (B, T-1).
        Packed (positions and segments given, attention_mask None): input_ids, positions,
        segments, targets (R, N) -> (R, N). 0 at IGNORE_INDEX."""
        with tied_head_gradient(self.policy) as deferred:  # a tied weight's one V x H gradient
            if positions is None:
                return score_targets(
                    self.policy,
                    input_ids,
                    attention_mask,
                    targets,
                    temperature=temperature,
                    deferred_weight_grad=deferred,
                )
            return packed_score_targets(
                self.policy,
                input_ids,
                positions,
                segments,
                targets,
                temperature=temperature,
                deferred_weight_grad=deferred,
            )


def micro_batch_logprobs(module, mb: MicroBatch | None, device: torch.device) -> torch.Tensor:
    """(b, T-1) fp32 logprobs of `mb`'s padded view by `module` (a LogprobModule, or the
    DeepSpeed engine around one) at the batch's own temperature, 0 off the response mask;
    packed micro-batches run packed. None: the empty micro-batch's forward on a two-token
    dummy row ((1, 1) zeros, on the autograd graph)."""
    if mb is None:
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        ignore = torch.full((1, 1), IGNORE_INDEX, dtype=torch.long, device=device)
        return module(ids, torch.ones_like(ids), ignore, 1.0)
    b, targets = mb.batch, mb.targets()
    if mb.packed is None:
        return module(b.input_ids, b.attention_mask, targets, b.logprob_temperature)
    p = mb.packed
    logp = module(p.input_ids, None, targets, b.logprob_temperature, p.positions, p.segments)
    return mb.logprobs_view(logp)


def frozen_copy(policy: nn.Module) -> LogprobModule:
    """The KL reference: a frozen deep copy of the initial policy (same patching), full on every rank."""
    reference = LogprobModule(copy.deepcopy(policy)).eval()
    reference.requires_grad_(False)
    return reference
