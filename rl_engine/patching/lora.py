"""LoRA adapters on a supported causal LM: PEFT builds them, the patch computes them invariantly.

`add_lora(model, rank=, alpha=, target_modules=, seed=)` injects PEFT LoRA layers
(`peft.tuners.lora.layer.Linear`: PEFT's module names, initialisation and file format) in
place, base weights frozen. `apply_batch_invariant` then swaps each LoRA layer's forward for

    y = linear(x, W) + scale * linear(linear(x, A), B),    scale = alpha / rank

with the model's resolved `linear` op on all three (its children are the patched
`InvariantLinear`s, called as modules so ZeRO-3 gathers their parameters), in that one order,
never merged into W: the trainer and the rollout engine serve the same unmerged expression.

Targets: 'all-linear' is every `nn.Linear` but the vocabulary head, the MoE routers and the
shared expert's gate. In transformers 5 the experts of mixture-of-experts families are 3-D
parameters, not `nn.Linear`, so there the adapters sit on attention and (Qwen2-MoE) the
shared expert's projections only: never a routed expert, nor a dense MLP layer of an MoE
model. PEFT is handed the full module paths, so it cannot widen them (for some MoE families
it maps `gate_proj` / `up_proj` / `down_proj` onto the 3-D experts, which the patch does not
compute invariantly); `add_lora` checks after injecting that every adapter wraps an
`nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.patching.modules import InvariantLinear
from rl_engine.patching.moe import is_router

ADAPTER = "default"
"""PEFT's name of the one adapter a policy carries."""
_NEVER_TARGETS = ("shared_expert_gate",)  # a gate of the MoE block, like the router


def lora_layer_class() -> type:
    """PEFT's LoRA layer around an `nn.Linear` (imported here only: PEFT is slow to import)."""
    from peft.tuners.lora.layer import Linear

    return Linear


def target_paths(model: nn.Module) -> dict[str, list[str]]:
    """Module name (last path part) -> the full paths of the linears an adapter may sit on:
    every `nn.Linear` but the vocabulary head, the routers and the shared expert's gate; in
    mixture-of-experts families only attention's and the shared expert's."""
    head = model.get_output_embeddings()
    moe = _is_moe(model)
    paths: dict[str, list[str]] = {}
    for parent_name, parent in model.named_modules():
        if is_router(parent):
            continue
        if moe and not (parent_name.endswith("self_attn") or ".shared_expert" in f".{parent_name}"):
            continue
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child is not head and name not in _NEVER_TARGETS:
                paths.setdefault(name, []).append(f"{parent_name}.{name}" if parent_name else name)
    return paths


def linear_names(model: nn.Module) -> list[str]:
    """The module names (last path part) an adapter may target (`target_paths`), sorted."""
    return sorted(target_paths(model))


def _is_moe(model: nn.Module) -> bool:
    from rl_engine.patching.families import family_for

    return family_for(model.config).moe is not None


def resolve_targets(model: nn.Module, target_modules: str | list[str]) -> list[str]:
    """`lora.target_modules` as the module names of `model`: 'all-linear' -> every name of
    `linear_names`; a list is checked against them (ValueError naming the key and listing
    what exists)."""
    existing = linear_names(model)
    if target_modules == "all-linear":
        return existing
    unknown = [name for name in target_modules if name not in existing]
    if unknown:
        model_type = getattr(model.config, "model_type", type(model).__name__)
        raise ValueError(
            f"lora.target_modules: {unknown} match no linear module of this {model_type} model "
            f"an adapter may sit on; those are {existing} (the vocabulary head, routers and MoE "
            "gates are never targets; in MoE families only attention and shared-expert "
            "linears are: in transformers 5 MoE experts are 3-D parameters, not linears)"
        )
    return sorted(set(target_modules))


def add_lora(
    model: nn.Module, *, rank: int, alpha: float, target_modules: str | list[str], seed: int
) -> nn.Module:
    """Inject PEFT LoRA layers into `model` in place (before patching); base weights frozen.

    PEFT initialises A (Kaiming) from the global generator, B = 0: drawn here under
    `seed` so every rank and every engine builds the same adapter.
    """
    from peft import LoraConfig, inject_adapter_in_model

    from rl_engine.patching.handle import is_patched

    if is_patched(model):
        raise ValueError(
            "add LoRA adapters before apply_batch_invariant (revert() the patch first)"
        )
    if rank < 1:
        raise ValueError(f"lora.rank must be an int >= 1 to add adapters, got {rank!r}")
    paths = target_paths(model)
    targets = [path for name in resolve_targets(model, target_modules) for path in paths[name]]
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none"
    )
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    model.to(dtype)  # the adapters in the model's dtype, like every other weight
    check_injected(model, set(targets))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    return model


def check_injected(model: nn.Module, targets: set[str]) -> None:
    """PEFT put a LoRA `Linear` on exactly `targets`, each around an `nn.Linear` (no 3-D
    expert parameter, no other layer type: the patch computes those adapters alone)."""
    adapted = {name for name, _ in lora_layers(model)}
    strays = sorted(
        {n.split(".lora_", 1)[0] for n, _ in model.named_parameters() if is_adapter_name(n)}
        - adapted
    )
    wrong = [p for p, m in lora_layers(model) if type(m.base_layer) is not nn.Linear]
    if adapted != targets or strays or wrong:
        raise NotImplementedError(
            f"PEFT placed adapters other than on the target linears: missing "
            f"{sorted(targets - adapted)[:3]}, unexpected {sorted(adapted - targets)[:3]}, "
            f"on other parameters {strays[:3]}, around a non-linear {wrong[:3]}"
        )


def is_adapter_name(name: str) -> bool:
    """True for a LoRA adapter's parameter name (PEFT's `lora_A` / `lora_B`)."""
    return ".lora_A." in name or ".lora_B." in name


def base_fingerprint(model: nn.Module) -> str:
    """A content hash (BLAKE2b) of every base tensor of a LoRA model (name, dtype, shape and
    bytes; adapters excluded), in name order: a checkpoint's adapters fit only this base.
    Call before ZeRO-3 partitions the parameters."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        if is_adapter_name(name):
            continue
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def has_lora(model: nn.Module) -> bool:
    """True when `model` carries PEFT LoRA layers."""
    return bool(lora_layers(model))


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, PEFT LoRA layer) of every adapted linear, in model order."""
    if not any(".lora_A." in name for name, _ in model.named_parameters()):
        return []  # no PEFT import for a model without adapters
    cls = lora_layer_class()
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def check_adapter_shape(model: nn.Module, rank: int, scale: float) -> None:
    """Every LoRA layer of `model` has rank `rank` and scale `scale` (lora.rank, alpha / rank)."""
    for path, layer in lora_layers(model):
        r, s = layer.r.get(ADAPTER), layer.scaling.get(ADAPTER)
        if r != rank or s != scale:
            raise ValueError(
                f"LoRA layer {path} has rank {r} and scale {s}, but lora.rank is {rank} and "
                f"lora.alpha / lora.rank is {scale}"
            )


def check_plain_lora(path: str, layer: nn.Module) -> None:
    """The LoRA layer is the one unmerged, dropout-free, vanilla adapter the invariant forward computes."""
    problems = []
    if list(layer.lora_A) != [ADAPTER] or list(layer.lora_B) != [ADAPTER]:
        problems.append(f"adapters {list(layer.lora_A)} (one, {ADAPTER!r}, is supported)")
    if layer.merged:
        problems.append("its adapter is merged into the base weight")
    if layer.disable_adapters:
        problems.append("its adapters are disabled")
    if layer.lora_variant or getattr(layer, "use_dora", {}).get(ADAPTER, False):
        problems.append("a LoRA variant (DoRA, ...)")
    if not isinstance(layer.lora_dropout[ADAPTER], nn.Identity):
        problems.append("dropout > 0")
    if problems:
        raise NotImplementedError(f"LoRA layer {path}: " + "; ".join(problems))


class InvariantLoraForward:
    """The forward a patched PEFT LoRA layer runs (an instance attribute: `revert` deletes it)."""

    def __init__(self, layer: nn.Module, path: str):
        for part in (layer.base_layer, layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]):
            if not isinstance(part, InvariantLinear):
                raise RuntimeError(
                    f"LoRA layer {path}: {type(part).__name__} was not patched to InvariantLinear"
                )
        self.layer, self.scale = layer, float(layer.scaling[ADAPTER])

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            raise TypeError("the invariant LoRA forward takes the hidden states alone")
        layer = self.layer
        x_base, x_lora = (x, x) if not _tracked(x) else _Fork.apply(x)
        down = layer.lora_A[ADAPTER](x_lora)
        return layer.base_layer(x_base) + self.scale * layer.lora_B[ADAPTER](down)


def _tracked(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class _Fork(torch.autograd.Function):
    """x as two views whose gradients this node adds (base + adapter) before handing x one.

    Without it x's gradient buffer takes the base's and the adapter's gradient as two of its
    consumers' terms, and the sibling layers' (q, k, v) join the same sum; ZeRO-3 wraps each
    module's inputs in a node of its own, which groups each layer's two terms first: another
    association, other bits. With the fork a LoRA layer is one consumer of x at every stage."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_base, grad_lora):
        if grad_base is None or grad_lora is None:
            return grad_lora if grad_base is None else grad_base
        return grad_base + grad_lora


# ----------------------------------------------------------------------------- export


def adapter_files(model: nn.Module, base_name: str) -> tuple[object, dict[str, torch.Tensor]]:
    """(PEFT LoraConfig naming `base_name`, tensors under PEFT's saved names): what
    `PeftModel.save_pretrained` writes, so `PeftModel.from_pretrained(base, DIR)` loads it."""
    import copy

    from peft import get_peft_model_state_dict

    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base_name
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    tensors = {f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    return config, tensors


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own (HF) names with every adapter folded in:
    W + scale * B @ A computed in fp32 and rounded once to W's dtype; every other tensor is
    the base's, bitwise."""
    merged = {}
    for name, tensor in model.state_dict().items():
        if not is_adapter_name(name):
            merged[name.replace(".base_layer.", ".")] = tensor
    for path, layer in lora_layers(model):
        weight = layer.base_layer.weight
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        delta = float(layer.scaling[ADAPTER]) * (b.float() @ a.float())
        merged[f"{path}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged
