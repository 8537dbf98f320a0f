"""Hugging Face's eager experts loop, the reference of the fused experts ops; the MoE tests' shapes,
inputs, and their skip of a native case where the platform probe refuses its dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers.invariance import skip_if_refused

HIDDEN, EXPERTS, TOP_K, WIDTH = 72, 10, 3, 22


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def experts_weights(dtype, experts=EXPERTS, hidden=HIDDEN, width=WIDTH, seed=1):
    gate_up = randn(experts, 2 * width, hidden, dtype=dtype, seed=seed, scale=hidden**-0.5)
    down = randn(experts, hidden, width, dtype=dtype, seed=seed + 1, scale=width**-0.5)
    return gate_up, down


def skip_native_where_refused(request) -> None:
    """A native case runs only where the platform probe accepts its dtype (fp32 by default):
    native refuses a dtype whose library GEMM is not row-invariant on this CPU (fail closed)."""
    params = getattr(request.node, "callspec", None)
    params = params.params if params else {}
    if params.get("backend") == "native":
        skip_if_refused("native", params.get("dtype", torch.float32))


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
