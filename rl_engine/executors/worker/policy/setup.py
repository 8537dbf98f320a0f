"""The policy a worker trains (and the critic's backbone): loaded, given its LoRA adapter,
moved to the device and patched, before DeepSpeed wraps it."""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.config import RunConfig
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant, patch_handle
from rl_engine.patching.lora import add_lora, base_fingerprint, check_adapter_shape, has_lora


def load_policy(config: RunConfig, *, adapter_seed: int | None = None):
    """(model, tokenizer): `load_model(config.model, seed=config.seed)` with the `lora:`
    section's adapter when its rank > 0 (PEFT's, initialised from `adapter_seed`, default
    config.seed: every rank and every engine builds the same one). Unpatched, on the CPU."""
    check_no_diagnostics_adapter(config)
    model, tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
    return with_lora(model, config, seed=adapter_seed), tokenizer


def check_no_diagnostics_adapter(config: RunConfig) -> None:
    """A policy to train never takes the `adapter:` key (diagnostics' adapter folder)."""
    if config.adapter is not None:
        raise ValueError(
            f"adapter: {config.adapter!r} is read by `rl-engine diagnose --config` only; a "
            "trained policy's adapter is the lora: section's, drawn from the run's seed"
        )


def with_lora(model: nn.Module, config: RunConfig, *, seed: int | None = None) -> nn.Module:
    """`model` with the `lora:` section's adapter added (unless it has one already), drawn
    from `seed` (default config.seed); a model with an adapter when lora.rank is 0 raises."""
    lora = config.lora
    if has_lora(model):
        if not lora.enabled:
            raise ValueError("the model carries LoRA adapters but lora.rank is 0")
        check_adapter_shape(model, lora.rank, lora.scale)
        return model
    if not lora.enabled:
        return model
    return add_lora(
        model,
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=lora.target_modules,
        seed=config.seed if seed is None else seed,
    )


def prepare_policy(
    model: nn.Module | None,
    config: RunConfig,
    device: torch.device,
    *,
    adapter_seed: int | None = None,
) -> nn.Module:
    """The worker's policy on `device`: `model`, else `load_policy(config)`'s; with
    `lora.rank` > 0 it carries the adapter (only its parameters train), drawn from
    `adapter_seed` (default config.seed) when the model has none yet.

    Moved first, then patched when `config.batch_invariant` (patching resolves the ops for
    the device); a model patched for another device, or patched without batch_invariant, raises.
    """
    check_no_diagnostics_adapter(config)
    if model is None:
        model, _ = load_policy(config, adapter_seed=adapter_seed)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if patch_handle(model) is None:
        model = with_lora(model, config, seed=adapter_seed)
    elif config.lora.enabled and not has_lora(model):
        raise ValueError(
            "lora.rank > 0 but the model is patched without adapters: pass it unpatched"
        )
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != [str(config.torch_dtype)]:
        raise ValueError(f"model parameters are {dtypes} but dtype is {config.dtype!r}")
    handle = patch_handle(model)
    if handle is not None and handle.device_type != device.type:
        raise ValueError(
            f"model was patched for {handle.device_type!r} but the worker runs on "
            f"{device}: pass it unpatched (the worker moves it, then patches)"
        )
    model = model.to(device)  # move first: patching resolves the ops for this device
    if config.batch_invariant and handle is None:
        apply_batch_invariant(model)  # before deepspeed.initialize: same Parameter objects
    elif not config.batch_invariant and handle is not None:
        raise ValueError("model is patched (batch-invariant kernels) but batch_invariant is false")
    return model


def checkpoint_activations(model: nn.Module, config: RunConfig) -> None:
    """With `trainer.activation_checkpointing`, each of `model`'s decoder layers recomputes
    its forward in the backward instead of holding its activations (Hugging Face's layer
    checkpointing, torch's non-reentrant checkpoint; only in training mode). Called on the
    trained model before DeepSpeed wraps it, after the frozen KL reference is copied: the
    reference never runs a backward."""
    if not config.trainer.activation_checkpointing:
        return
    kwargs = {"use_reentrant": False}
    # newer transformers (5.25 here) name it activation_checkpointing_enable (the old name warns);
    # 5.19, which vLLM's CPU build needs, has only gradient_checkpointing_enable
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def base_record(policy: nn.Module, config: RunConfig) -> dict | None:
    """A LoRA policy's base as its checkpoints record it ({"model", "hash"}); None without LoRA."""
    if not config.lora.enabled:
        return None
    return {"model": config.model, "hash": base_fingerprint(policy)}
