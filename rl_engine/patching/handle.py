"""The handle a patched model carries: what `apply_batch_invariant` changed and how to revert it.

Apart from apply.py so that the modules apply.py patches with (LoRA, adapters) can ask whether
a model is patched without importing the patcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from rl_engine.kernels import BackendLayout

HANDLE_ATTR = "_rl_engine_patch"  # the model attribute that holds its PatchHandle


@dataclass
class PatchHandle:
    """What `apply_batch_invariant` changed; `revert()` puts the original modules back."""

    model: nn.Module
    backend: str
    """The backend every op was resolved from."""
    device_type: str
    """The device type the ops were resolved for (the parameters' at patch time)."""
    ops: dict[str, Callable]
    """Op name -> the resolved function (the engine and the trainer score with these)."""
    layout: BackendLayout
    """The backend's layout facts (KV-cache block and dtype)."""
    attention_name: str
    """transformers' attn_implementation the model now uses."""
    replaced: list[str] = field(default_factory=list)
    _originals: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)
    _lora_forwards: list[nn.Module] = field(default_factory=list, repr=False)
    _attn_before: str | None = None
    active: bool = True

    def revert(self) -> None:
        if not self.active:
            return
        for layer in self._lora_forwards:
            del layer.forward  # PEFT's own forward again
        for parent, name, original in reversed(self._originals):
            setattr(parent, name, original)
        self.model.set_attn_implementation(self._attn_before or "sdpa")
        delattr(self.model, HANDLE_ATTR)
        self.active = False

    def summary(self) -> dict[str, int]:
        """Count of replacements per kind, e.g. {'linear': 14, 'rms_norm': 5, ...}."""
        counts: dict[str, int] = {}
        for entry in self.replaced:
            kind = entry.split(":", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def patch_handle(model: nn.Module) -> PatchHandle | None:
    """The active handle of a patched model, or None."""
    handle = getattr(model, HANDLE_ATTR, None)
    return handle if handle is not None and handle.active else None


def is_patched(model: nn.Module) -> bool:
    return patch_handle(model) is not None
