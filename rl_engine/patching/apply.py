"""`apply_batch_invariant(model, *, backend=None)`: swap every op on the logprob path for an invariant one.

Replaced, in place: the input embedding, every `nn.Linear` (q/k/v/o, gate/up/down),
the vocabulary projection (fp32 logits), every RMSNorm (incl. Qwen3 q/k norms),
the MLP activation, attention (through transformers' attention registry), and in
mixture-of-experts families every router, every experts module and, with a
shared expert, its sparse block (rl_engine/patching/moe.py); the forward of every
PEFT LoRA layer becomes the invariant unmerged expression (rl_engine/patching/lora.py).
Every op is resolved once, here, through `get_op(name, device, backend)` for the
device of the model's parameters: move the model first, then patch. The new
modules hold the resolved functions and the *same* Parameter objects, so an
optimizer or DeepSpeed engine built before or after keeps working and tied
weights stay tied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rl_engine.kernels import OP_NAMES, backend_layout, get_op, resolve_backend
from rl_engine.patching.attention import attention_name, register_attention
from rl_engine.patching.families import Family, family_for
from rl_engine.patching.handle import HANDLE_ATTR, PatchHandle, patch_handle
from rl_engine.patching.lora import InvariantLoraForward, check_plain_lora, lora_layers
from rl_engine.patching.modules import (
    InvariantEmbedding,
    InvariantLinear,
    InvariantLMHead,
    InvariantRMSNorm,
    InvariantSiLU,
)
from rl_engine.patching.moe import (
    InvariantSharedExpertMoeBlock,
    moe_replacement,
    shared_expert_blocks,
)


def apply_batch_invariant(model: nn.Module, *, backend: str | None = None) -> PatchHandle:
    """Patch a supported HF causal LM in place, for the device its parameters are on.

    backend: None = the device's default (cpu: cpp, cuda: triton); or a name
    the registry accepts for that device. Applying twice returns the existing
    handle (asking for another backend then raises: revert first).
    """
    existing = getattr(model, HANDLE_ATTR, None)
    if existing is not None and existing.active:
        if backend is not None and backend != existing.backend:
            raise ValueError(
                f"model is already patched with backend {existing.backend!r}; revert() it "
                f"before patching with {backend!r}"
            )
        return existing
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a Hugging Face PreTrainedModel, got {type(model).__name__}")
    family = family_for(config)
    device = parameter_device(model)
    name = resolve_backend(device, backend)
    handle = PatchHandle(
        model=model,
        backend=name,
        device_type=device.type,
        ops={op: get_op(op, device, name) for op in OP_NAMES},
        layout=backend_layout(device, name),
        attention_name=attention_name(name),
    )
    _swap_modules(model, family, handle)
    handle._attn_before = config._attn_implementation
    register_attention(name, handle.ops["attention"])
    model.set_attn_implementation(handle.attention_name)
    handle.replaced.append(f"attention: {handle._attn_before} -> {handle.attention_name}")
    setattr(model, HANDLE_ATTR, handle)
    return handle


def model_op(model: nn.Module, name: str) -> Callable:
    """Op `name` as the model computes it: the patched model's resolved op (its backend),
    or, for an unpatched model, the default op of its parameters' device."""
    handle = patch_handle(model)
    if handle is not None:
        return handle.ops[name]
    return get_op(name, parameter_device(model))


def parameter_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters; they must all share one device type."""
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError(f"{type(model).__name__} has no parameters: cannot tell its device")
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            f"the model's parameters are on several device types ({sorted(map(str, devices))}); "
            "move the whole model to one device before patching"
        )
    return next(iter(devices))


def _swap_modules(model: nn.Module, family: Family, handle: PatchHandle) -> None:
    # Blocks with a shared expert first: the new block holds the same children, which
    # the walk below then patches where they now live (revert undoes both in reverse).
    tags = (handle.backend, handle.device_type)
    for parent, child_name, block in shared_expert_blocks(model, family):
        new_block = InvariantSharedExpertMoeBlock(block, handle.ops["sigmoid"], *tags)
        _swap(
            handle,
            parent,
            child_name,
            block,
            new_block,
            "moe_block",
            _path(model, parent, child_name),
        )
    input_embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    # Collect first, then swap: never mutate the tree while walking it.
    targets, replaced = [], set()
    for parent_name, parent in model.named_modules():
        if id(parent) in replaced:  # inside a module replaced as a whole (router, experts)
            replaced.update(id(m) for m in parent.children())
            continue
        for child_name, child in parent.named_children():
            replacement = _replacement_for(
                child, child_name, family, input_embeddings, output_embeddings, handle, model.config
            )
            if replacement is not None:
                path = f"{parent_name}.{child_name}" if parent_name else child_name
                targets.append((parent, child_name, child, replacement, path))
                replaced.add(id(child))
    for parent, child_name, child, (kind, new_module), path in targets:
        _swap(handle, parent, child_name, child, new_module, kind, path)
    _swap_lora_forwards(model, handle)


def _swap_lora_forwards(model: nn.Module, handle: PatchHandle) -> None:
    """Each PEFT LoRA layer computes the invariant unmerged expression (its children, base
    layer and A / B, were patched by the walk above)."""
    layers = lora_layers(model)
    for path, layer in layers:
        check_plain_lora(path, layer)
    for path, layer in layers:
        layer.forward = InvariantLoraForward(layer, path)
        handle._lora_forwards.append(layer)
        handle.replaced.append(f"lora: {path}")


def _swap(handle, parent, child_name, child, new_module, kind, path) -> None:
    setattr(parent, child_name, new_module)
    handle._originals.append((parent, child_name, child))
    handle.replaced.append(f"{kind}: {path}")


def _path(model: nn.Module, parent: nn.Module, child_name: str) -> str:
    parent_name = next(name for name, m in model.named_modules() if m is parent)
    return f"{parent_name}.{child_name}" if parent_name else child_name


def _replacement_for(
    child, child_name, family, input_embeddings, output_embeddings, handle, config
):
    ops, tags = handle.ops, (handle.backend, handle.device_type)
    moe = moe_replacement(child, family, config, ops, tags)
    if moe is not None:
        return moe
    if child is output_embeddings:
        return "lm_head", InvariantLMHead(child, ops["lm_head"], *tags)
    if child is input_embeddings:
        return "embedding", InvariantEmbedding(child, ops["embedding"], *tags)
    if type(child) is nn.Linear:
        return "linear", InvariantLinear(child, ops["linear"], *tags)
    if type(child).__name__.endswith(family.norm_class_suffix):
        return "rms_norm", InvariantRMSNorm(child, ops["rms_norm"], *tags)
    if child_name == "act_fn":
        return "silu", InvariantSiLU(ops["silu"], *tags)
    return None


def lm_head_parameters(model: nn.Module) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """(weight, bias) of the vocabulary projection, patched or not."""
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)
