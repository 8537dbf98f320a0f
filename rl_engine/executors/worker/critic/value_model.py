"""The critic's model: the policy's backbone (patched like the policy) and a scalar value head.

`ValueModule` is what the critic hands to `deepspeed.initialize`: the Hugging Face
decoder without its LM head (`model.base_model`) to its final hidden states, then
`ValueHead`, an `nn.Linear(hidden, 1)` computed by the model's own `linear` op (with
`batch_invariant`, the invariant kernel the decoder's projections use). Position t
of the (b, T-1) result is V(tokens <= t): the value of the state from which token
t + 1 is sampled, aligned with `TrainBatch.response_mask`. Packed rows give the same
bits as the padded layout (the patched decoder is packing-invariant).

The head starts at zero (weight and bias): every rank and every run starts from the
same values, V = 0, so the first GAE advantages are the returns themselves.

Layout-invariant training (`trainer.layout_invariant`): the route bound to the module
(patching/gradient_route.py) says which head rows are whose; they are the rows `linear_logp`
scores in the policy (position t of a sequence's first L-1 tokens), so the head gets the
route's `logp_kwargs` and its backward sends each sequence's weight and bias partials to the
step's sink like every projection of the decoder.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rl_engine.logprobs import final_hidden_states, packed_final_hidden_states
from rl_engine.patching import model_op
from rl_engine.patching.gradient_route import gradient_route


class ValueHead(nn.Module):
    """Hidden states (..., H) -> fp32 values (...), through the given `linear` op."""

    def __init__(self, hidden_size: int, linear: Callable, *, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self._linear = linear

    def forward(self, hidden: torch.Tensor, **route) -> torch.Tensor:
        """`route`: the layout-invariant mode's spans= / sink= (none otherwise)."""
        return self._linear(hidden, self.weight, self.bias, **route).float().squeeze(-1)


class ValueModule(nn.Module):
    """HF decoder (no LM head) -> final hidden states -> `ValueHead`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        first = next(model.parameters())
        linear = model_op(model, "linear")  # the patched model's op: its backend's kernel
        self.backbone = model.base_model
        self.head = ValueHead(
            model.config.hidden_size, linear, dtype=first.dtype, device=first.device
        )

    def forward(self, input_ids, attention_mask, positions=None, segments=None) -> torch.Tensor:
        """Padded: input_ids/attention_mask (B, T) -> fp32 values (B, T-1) of positions 0..T-2.
        Packed (positions and segments given, attention_mask None): (R, N) -> (R, N)."""
        route = gradient_route(self)
        route = {} if route is None else route.logp_kwargs()
        if positions is None:
            hidden = final_hidden_states(self.backbone, input_ids, attention_mask)  # (B, T, H)
            return self.head(hidden[:, :-1], **route)
        hidden = packed_final_hidden_states(self.backbone, input_ids, positions, segments)
        return self.head(hidden, **route)
