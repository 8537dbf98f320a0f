"""A PEFT adapter folder onto its base model, for scoring: `load_adapter(model, DIR)`.

The folder is what `PeftModel.save_pretrained` (and `rl-engine export RUN --to DIR`) writes:
adapter_config.json and adapter_model.safetensors, tensors named
`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`. PEFT injects the layers
the config names (`inject_adapter_in_model`, PEFT's own placement), then every tensor of the
file is copied into its layer, checked name by name and shape by shape: an adapter of another
base fails here, naming the file and the tensor, never later inside a forward.

Only what `apply_batch_invariant` computes invariantly loads: plain LoRA on `nn.Linear`s
(no DoRA, no LoRA bias, no trained bias, no fully trained modules, no adapters on 3-D expert
parameters). The adapter's dropout is dropped: scoring is inference, where PEFT's dropout is
the identity, and the invariant forward computes the adapter without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rl_engine.patching.lora import ADAPTER, check_injected, has_lora, is_adapter_name, lora_layers

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""PeftModel's prefix of every saved tensor name (the wrapper's path to the base model)."""
# config field -> the value plain LoRA has; anything else is a variant the patch cannot compute
PLAIN = {
    "use_dora": False,
    "lora_bias": False,
    "bias": "none",
    "modules_to_save": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "layer_replication": None,
}


def load_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Add the adapter saved in `directory` to `model` (unpatched, without adapters) in place:
    PEFT's layers, the file's tensors in the model's dtype, every parameter frozen.

    Raises FileNotFoundError for a missing file, ValueError naming the file for an adapter
    that is not plain LoRA or does not fit this base (a target it lacks, a tensor missing,
    extra or of another shape).
    """
    from peft import LoraConfig, inject_adapter_in_model
    from safetensors.torch import load_file

    from rl_engine.patching.handle import is_patched

    if is_patched(model) or has_lora(model):
        raise ValueError("load an adapter onto the unpatched base model, without adapters")
    folder = Path(directory)
    config_file, weights_file = _files(folder)
    _check_plain_lora_config(config_file)
    config = LoraConfig.from_pretrained(str(folder))
    config.lora_dropout = 0.0  # scoring is inference: dropout is the identity there
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):  # PEFT's init draws; the file overwrites it
        try:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as err:
            raise ValueError(f"{config_file}: does not fit this base model: {err}") from None
    model.to(dtype)
    check_injected(model, {name for name, _ in lora_layers(model)})
    _copy_tensors(model, load_file(weights_file), weights_file)
    model.requires_grad_(False)
    return model


def _files(folder: Path) -> tuple[Path, Path]:
    files = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(
                f"adapter: {file} not found (a PEFT adapter folder, as `rl-engine export RUN "
                f"--to DIR` or PeftModel.save_pretrained writes it, holds {CONFIG_FILE} and "
                f"{WEIGHTS_FILE})"
            )
    return files


def _check_plain_lora_config(config_file: Path) -> None:
    """The config is plain LoRA (ValueError naming the file)."""
    try:
        fields = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file}: not JSON ({err})") from None
    if not isinstance(fields, dict) or fields.get("peft_type") != "LORA":
        kind = fields.get("peft_type") if isinstance(fields, dict) else type(fields).__name__
        raise ValueError(
            f"{config_file}: peft_type is {kind!r}; only a LoRA adapter ('LORA') loads"
        )
    unsupported = {
        key: fields[key]
        for key, plain in PLAIN.items()
        if fields.get(key) not in (plain, None, [], {})
    }
    if unsupported:
        raise ValueError(
            f"{config_file}: {unsupported} is not plain LoRA on linear layers, which is all the "
            "batch-invariant forward computes"
        )


def _copy_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Each saved tensor into its parameter (`<path>.lora_A.weight` -> `<path>.lora_A.default.weight`)."""
    params = {name: p for name, p in model.named_parameters() if is_adapter_name(name)}
    wanted = {}
    for key in tensors:
        name = key.removeprefix(PREFIX)
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{ADAPTER}.")
        wanted[name] = key
    missing, extra = sorted(params.keys() - wanted.keys()), sorted(wanted.keys() - params.keys())
    if missing or extra:
        raise ValueError(
            f"{source}: does not fit this base model: {len(missing)} adapter tensor(s) missing "
            f"(first {missing[:2]}), {len(extra)} unexpected (first {[wanted[n] for n in extra[:2]]})"
        )
    with torch.no_grad():
        for name, param in params.items():
            tensor = tensors[wanted[name]]
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{source}: {wanted[name]} is {tuple(tensor.shape)} but this base model's "
                    f"layer needs {tuple(param.shape)}: an adapter of another base model"
                )
            param.copy_(tensor.to(param.dtype))
