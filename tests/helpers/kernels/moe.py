"""Hugging Face's eager experts loop, the reference of the fused experts ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hf_eager_experts(hidden, gate_up, down, indices, weights, linear=F.linear, act=F.silu):
    """Hugging Face's eager `*Experts.forward` (transformers 5.24), with its linear and act swappable."""
    final = torch.zeros_like(hidden)
    mask = F.one_hot(indices, num_classes=gate_up.shape[0] + 1).permute(2, 1, 0)
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        expert = expert[0]
        slot, token = torch.where(mask[expert])
        gate, up = linear(hidden[token], gate_up[expert]).chunk(2, dim=-1)
        current = linear(act(gate) * up, down[expert]) * weights[token, slot, None]
        final.index_add_(0, token, current.to(final.dtype))
    return final
