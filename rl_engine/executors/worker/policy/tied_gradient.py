"""The gradient of a weight the input embedding and the LM head share, formed at the end of the backward.

Autograd sums a tied weight's two gradients: the LM head's (V x H, made by the first
backward step, when every layer's activations are still held) waits in autograd's buffer
through the whole backward of the decoder, and the embedding's dense V x H gradient joins
it at the end. On the Qwen2.5-0.5B shape (bf16) each is 272 MB a rank, beside the gathered
weight and the activations. Within `tied_head_gradient`:

- the LM head's `linear_logp` keeps its weight gradient as the chunks' parts (when they take
  no more memory than the gradient: `WeightGradient.deferrable`) and returns none;
- the embedding's output passes through `_JoinTiedGradient`, whose backward, reached once
  every layer's backward has run, forms the head's gradient and adds the embedding's rows
  into it in place (`kernels.common.embedding.add_embedding_grad_`): one V x H gradient,
  the same bits as autograd's sum, and the embedding's own backward gets no gradient to turn
  into a dense one.

When the head's gradient is not deferred (a micro-batch with more tokens than the hidden
size) the join passes the embedding's gradient through and autograd sums as before; off
the CPU (whose dense embedding backward the fold is tested against) nothing changes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from rl_engine.kernels.common.embedding import add_embedding_grad_
from rl_engine.patching import lm_head_parameters
from rl_engine.patching.gradient_route import gradient_route


class _JoinTiedGradient(torch.autograd.Function):
    """Identity on the embedding's output; its backward returns the tied weight's whole gradient."""

    @staticmethod
    def forward(ctx, weight, embeds, ids, deferred: list, padding_idx):
        ctx.save_for_backward(ids)
        ctx.deferred, ctx.padding_idx = deferred, padding_idx
        return embeds.clone()  # a new tensor: its grad comes back to this node

    @staticmethod
    def backward(ctx, grad_embeds):
        if not ctx.deferred:  # the head returned its gradient itself: autograd sums
            return None, grad_embeds, None, None, None
        (ids,) = ctx.saved_tensors
        grad_weight = ctx.deferred.pop()()
        if ctx.deferred:
            raise RuntimeError("more than one deferred LM-head gradient in one forward")
        add_embedding_grad_(grad_weight, ids, grad_embeds, ctx.padding_idx)
        return grad_weight, None, None, None, None


def _ties_trained_weight(policy: nn.Module) -> bool:
    """The input embedding looks up the LM head's own trained weight, unscaled, on the CPU
    (where `add_embedding_grad_` is tested against torch's dense embedding backward)."""
    if not torch.is_grad_enabled() or not hasattr(policy, "get_input_embeddings"):
        return False
    embedding = policy.get_input_embeddings()
    weight, _ = lm_head_parameters(policy)
    scaled = any(getattr(embedding, name, None) is not None for name in ("_scale", "embed_scale"))
    return (
        weight.requires_grad
        and weight.device.type == "cpu"
        and getattr(embedding, "weight", None) is weight
        and not scaled
    )


@contextmanager
def tied_head_gradient(policy: nn.Module):
    """Within it, a forward of `policy` whose LM head shares its input embedding's trained
    weight forms that weight's gradient once, at the end of the backward. Yields the list
    to pass as the LM head's `deferred_weight_grad`, or None when the weight is not tied
    and trained (or grad is off), and in a layout-invariant forward (whose gradient route
    takes the embedding's and the head's per-sequence partials instead)."""
    route = gradient_route(policy)
    if not _ties_trained_weight(policy) or (route is not None and route.spans is not None):
        yield None
        return
    embedding = policy.get_input_embeddings()
    weight, deferred = embedding.weight, []

    def join(module, args, output):
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor):
            raise TypeError("tied_head_gradient: the input embedding was called without ids")
        return _JoinTiedGradient.apply(weight, output, ids, deferred, module.padding_idx)

    # prepend: before ZeRO-3's own forward hooks (which wrap the output for the embedding's
    # backward); the join's None for the embedding then leaves that backward nothing to do
    handle = embedding.register_forward_hook(join, prepend=True)
    try:
        yield deferred
    finally:
        handle.remove()
