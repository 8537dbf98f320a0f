"""LoRA policies for tests: PEFT's adapter with A and B drawn from a seeded generator.

PEFT initialises B = 0, so a fresh adapter changes nothing and a test of it proves nothing;
`perturb_adapters` gives A and B small random values so the adapter term matters.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.models import load_model
from rl_engine.patching.lora import ADAPTER, add_lora, lora_layers
from rl_engine.patching.modules import InvariantLinear


@torch.no_grad()
def perturb_adapters(model: nn.Module, seed: int = 7, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            noise = torch.randn(param.shape, generator=g, dtype=torch.float32) * scale
            param.copy_(noise.to(param.dtype))


def lora_model(name: str, dtype=torch.float32, rank: int = 4, targets="all-linear", seed: int = 0):
    """Tiny `name` with a perturbed PEFT adapter (alpha = 2 x rank), unpatched."""
    model, _ = load_model(name, dtype=dtype, seed=seed)
    add_lora(model, rank=rank, alpha=2 * rank, target_modules=targets, seed=seed)
    perturb_adapters(model)
    return model


def merge_adapters(model: nn.Module) -> None:
    """Negative control: fold every adapter into its base weight (PEFT's merge) and put the
    base linear back in the LoRA layer's place, in place."""
    for path, layer in lora_layers(model):
        layer.merge(adapter_names=[ADAPTER])
        parent_name, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.base_layer)


def unpatch_adapters(model: nn.Module) -> None:
    """Negative control: a patched model whose LoRA layers run plain PEFT again (its own
    forward, torch's linear for A and B; the base layer stays patched)."""
    for _, layer in lora_layers(model):
        del layer.forward
        for modules in (layer.lora_A, layer.lora_B):
            patched = modules[ADAPTER]
            assert isinstance(patched, InvariantLinear)
            plain = nn.Linear(patched.in_features, patched.out_features, bias=False)
            plain.weight = patched.weight
            modules[ADAPTER] = plain
