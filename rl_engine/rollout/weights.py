"""Checked, in-place weight loading for the rollout engine.

`plan_weight_copy` validates a whole state dict against the model before
anything is written: unexpected names, missing names and shape mismatches raise
a ValueError naming the first offending key. Tied parameters (one tensor under
several names, e.g. `model.embed_tokens.weight` and `lm_head.weight`) need only
one of their names; if several are given they must hold equal values.
`copy_weights` then copies in place under `no_grad`, so the Parameter objects
(and anything holding them: the patched modules, an optimizer) stay the same.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def _tied_groups(model: nn.Module) -> dict[int, list[str]]:
    """id(tensor) -> every state-dict name of that tensor, in state-dict order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return groups


def plan_weight_copy(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(model tensor, new value)] for every tensor of the model; raises ValueError before any write."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    targets = model.state_dict(keep_vars=True)
    for name, value in state_dict.items():
        if name not in targets:
            raise ValueError(
                f"state_dict has unexpected key {name!r} (not a parameter or buffer of the model)"
            )
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] must be a tensor, got {type(value).__name__}")
    plan = []
    for names in _tied_groups(model).values():
        present = [n for n in names if n in state_dict]
        if not present:
            raise ValueError(f"state_dict is missing key {names[0]!r}")
        target = targets[names[0]]
        for name in present:
            if tuple(state_dict[name].shape) != tuple(target.shape):
                raise ValueError(
                    f"state_dict[{name!r}] has shape {tuple(state_dict[name].shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
        _check_tied_values(state_dict, present)
        plan.append((target, state_dict[present[0]]))
    return plan


def _check_tied_values(state_dict, names: list[str]) -> None:
    first = state_dict[names[0]]
    for name in names[1:]:
        other = state_dict[name]
        if other is not first and not torch.equal(other.to(first.device, first.dtype), first):
            raise ValueError(
                f"state_dict[{name!r}] and state_dict[{names[0]!r}] are tied in the model but hold different values"
            )


@torch.no_grad()
def copy_weights(plan: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every new value into its model tensor in place (dtype and device cast by copy_)."""
    for target, value in plan:
        target.copy_(value)
