"""`apply_batch_invariant(model)`: swap every op on the logprob path for an invariant one.

Replaced, in place: the input embedding, every `nn.Linear` (q/k/v/o, gate/up/down),
the vocabulary projection (fp32 logits), every RMSNorm (incl. Qwen3 q/k norms),
the MLP activation, and attention (through transformers' attention registry).
The new modules hold the *same* Parameter objects, so an optimizer or DeepSpeed
engine built before or after keeps working and tied weights stay tied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from rl_engine.kernels.native.embedding import InvariantEmbedding
from rl_engine.kernels.native.linear import InvariantLinear, lm_head
from rl_engine.kernels.native.rms_norm import InvariantRMSNorm
from rl_engine.kernels.native.silu import InvariantSiLU
from rl_engine.patching.attention import ATTENTION_NAME, register_attention
from rl_engine.patching.families import Family, family_for

_HANDLE_ATTR = "_rl_engine_patch"


class InvariantLMHead(InvariantLinear):
    """Vocabulary projection returning fp32 logits; shares the original weight (tied or not)."""

    def forward(self, hidden):
        return lm_head(hidden, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, vocab={self.out_features}, fp32_logits=True, batch_invariant=True"


@dataclass
class PatchHandle:
    """What `apply_batch_invariant` changed; `revert()` puts the original modules back."""

    model: nn.Module
    replaced: list[str] = field(default_factory=list)
    _originals: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)
    _attn_before: str | None = None
    active: bool = True

    def revert(self) -> None:
        if not self.active:
            return
        for parent, name, original in reversed(self._originals):
            setattr(parent, name, original)
        self.model.set_attn_implementation(self._attn_before or "sdpa")
        delattr(self.model, _HANDLE_ATTR)
        self.active = False

    def summary(self) -> dict[str, int]:
        """Count of replacements per kind, e.g. {'linear': 14, 'rms_norm': 5, ...}."""
        counts: dict[str, int] = {}
        for entry in self.replaced:
            kind = entry.split(":", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def apply_batch_invariant(model: nn.Module) -> PatchHandle:
    """Patch a supported HF causal LM in place; applying twice returns the existing handle."""
    existing = getattr(model, _HANDLE_ATTR, None)
    if existing is not None and existing.active:
        return existing
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a Hugging Face PreTrainedModel, got {type(model).__name__}")
    family = family_for(config)
    handle = PatchHandle(model=model)
    _swap_modules(model, family, handle)
    handle._attn_before = config._attn_implementation
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    handle.replaced.append(f"attention: {handle._attn_before} -> {ATTENTION_NAME}")
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def is_patched(model: nn.Module) -> bool:
    handle = getattr(model, _HANDLE_ATTR, None)
    return handle is not None and handle.active


def _swap_modules(model: nn.Module, family: Family, handle: PatchHandle) -> None:
    input_embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    # Collect first, then swap: never mutate the tree while walking it.
    targets = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            replacement = _replacement_for(
                child, child_name, family, input_embeddings, output_embeddings
            )
            if replacement is not None:
                path = f"{parent_name}.{child_name}" if parent_name else child_name
                targets.append((parent, child_name, child, replacement, path))
    for parent, child_name, child, (kind, new_module), path in targets:
        setattr(parent, child_name, new_module)
        handle._originals.append((parent, child_name, child))
        handle.replaced.append(f"{kind}: {path}")


def _replacement_for(child, child_name, family, input_embeddings, output_embeddings):
    if child is output_embeddings:
        return "lm_head", InvariantLMHead(child)
    if child is input_embeddings:
        return "embedding", InvariantEmbedding(child)
    if type(child) is nn.Linear:
        return "linear", InvariantLinear(child)
    if type(child).__name__.endswith(family.norm_class_suffix):
        return "rms_norm", InvariantRMSNorm(child)
    if child_name == "act_fn":
        return "silu", InvariantSiLU()
    return None


def lm_head_parameters(model: nn.Module) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """(weight, bias) of the vocabulary projection, patched or not."""
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)
