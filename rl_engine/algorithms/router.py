"""Router terms of a mixture-of-experts policy: the load-balancing loss and the load of the experts.

`load_balancing_loss` is Hugging Face's `load_balancing_loss_func` (Switch
Transformer, eqs. 4-6; the same function in transformers 5.24's qwen3_moe,
qwen2_moe, mixtral and olmoe), over the L sparse layers and the real tokens
(mask):

    f_e = (token-slots routed to expert e, summed over layers) / (tokens x L)   (sums to k)
    P_e = (router probability of e, summed over layers and tokens) / (tokens x L)
    loss = E * sum_e f_e * P_e

Two choices differ from HF, on purpose: the counts come from the experts the
router actually chose (the invariant top-k, ties to the lowest index; HF
recounts with `torch.topk`, whose tie order is unspecified), and P is a
softmax in fp32 (HF takes it in the logits' dtype). On fp32 logits without
ties the value is HF's (tests/algorithms/test_router.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_balancing_loss(
    logits: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    num_experts: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar fp32 loss from each layer's router logits (N, E) and chosen experts (N, k).

    mask (N,): 1 / True for real tokens (the flattened attention mask), None for all.
    """
    if not logits or len(logits) != len(indices):
        raise ValueError(
            f"need one (logits, indices) pair per sparse layer, got {len(logits)} logits and "
            f"{len(indices)} indices"
        )
    rows = logits[0].shape[0]
    live = torch.ones(rows, device=logits[0].device) if mask is None else mask.reshape(-1).float()
    if live.shape[0] != rows:
        raise ValueError(f"mask has {live.shape[0]} tokens but the router logits have {rows}")
    counts = torch.zeros(num_experts, device=live.device)
    prob_sum = torch.zeros(num_experts, device=live.device)
    for layer_logits, layer_indices in zip(logits, indices):
        probs = torch.softmax(layer_logits.float(), dim=-1)  # (N, E)
        top_k = layer_indices.shape[1]
        counts = counts.index_add(0, layer_indices.reshape(-1), live.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * live[:, None]).sum(0)
    total = live.sum() * len(logits)
    return num_experts * torch.sum((counts / total) * (prob_sum / total))


def expert_counts(
    indices: Sequence[torch.Tensor], num_experts: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(L, E) fp64: token-slots each layer routed to each expert, real tokens only."""
    out = torch.zeros(len(indices), num_experts, dtype=torch.float64)
    for layer, layer_indices in enumerate(indices):
        kept = layer_indices if mask is None else layer_indices[mask.reshape(-1).bool()]
        out[layer] = torch.bincount(kept.reshape(-1).cpu(), minlength=num_experts).double()
    return out


def load_statistics(counts: torch.Tensor) -> dict[str, float]:
    """Expert load from (L, E) counts: the most loaded expert's share of the routed token-slots
    (1/E when balanced, 1.0 when one expert takes all; mean over layers and the worst layer),
    and the entropy of the load in nats (ln E when balanced; mean over layers)."""
    totals = counts.sum(-1, keepdim=True)
    share = counts / totals.clamp(min=1.0)  # (L, E)
    entropy = -(share * share.clamp(min=1e-300).log()).sum(-1)  # (L,)
    top = share.max(-1).values
    return {
        "max_load_share": float(top.mean()),
        "max_load_share_worst_layer": float(top.max()),
        "load_entropy": float(entropy.mean()),
    }
