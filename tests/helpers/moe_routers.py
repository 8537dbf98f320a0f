"""MoE routers with twin experts: exact or near ties that a plain router resolves by the batch."""

from __future__ import annotations

import torch

from rl_engine.patching import moe_layers


def twin_experts(model, scale: float = 0.0):
    """Experts 1 and 5 of every router get (nearly) the same weight row, which wins often:
    scale 0 gives exact ties, a tiny scale ties up to the rounding of the logits."""
    g = torch.Generator().manual_seed(4)
    for name in moe_layers(model):
        router = model.get_submodule(name)
        with torch.no_grad():
            row = router.weight[1] + 0.3 * router.weight.norm(dim=1).mean()
            router.weight[1] = row
            router.weight[5] = row * (1 + scale * torch.randn(row.shape, generator=g))
    return model
