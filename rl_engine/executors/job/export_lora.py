"""A LoRA run's checkpoint for the ecosystem: a PEFT adapter folder, or (`--merged`) a full HF folder.

The adapter folder holds adapter_config.json and adapter_model.safetensors, what
`PeftModel.save_pretrained` writes: `PeftModel.from_pretrained(base, DIR)` loads it onto the
run's base model. The merged folder is a plain Hugging Face model whose target weights are
W + scale * B @ A (computed in fp32, rounded once) and whose other tensors are the base's,
bitwise (`rl_engine.patching.lora.merged_state_dict`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_engine.config import RunConfig

ADAPTER_FILE = "adapter_model.safetensors"


def write_lora_export(
    config: RunConfig, weights: dict[str, torch.Tensor], staging: Path, merged: bool
):
    """Write the adapter folder (or the merged model) of a LoRA run's `weights` (the weights
    file: base and adapters under the PEFT-wrapped model's names) into `staging`; returns the
    run's tokenizer (or None) for the caller to save beside it."""
    from safetensors.torch import save_file

    from rl_engine.executors.worker.policy.setup import load_policy
    from rl_engine.patching.lora import adapter_files, merged_state_dict

    policy, tokenizer = load_policy(config)
    policy.load_state_dict(weights, strict=True)
    if merged:
        from rl_engine.models.build import random_model

        plain = random_model(policy.config, config.torch_dtype)
        plain.load_state_dict(merged_state_dict(policy), strict=True)
        plain.save_pretrained(staging, safe_serialization=True)
        return tokenizer
    peft_config, tensors = adapter_files(policy, config.model)
    staging.mkdir(parents=True)
    save_file(tensors, staging / ADAPTER_FILE, metadata={"format": "pt"})
    peft_config.save_pretrained(staging)
    return tokenizer
