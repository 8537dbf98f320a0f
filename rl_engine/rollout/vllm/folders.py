"""A Hugging Face folder vLLM can serve, written from a loaded model.

vLLM loads folders (safetensors + config.json), not GGUF files or models built in code, and
refuses a `quantization_config` (a GGUF-loaded model keeps `gguf` there although its weights
are dense). The folder holds the model's own tensors in its own dtype, so vLLM serves exactly
the weights the trainer starts from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def write_vllm_folder(model, folder: Path) -> Path:
    """Save `model` (any dtype, CPU) at `folder` (replaced atomically) without its
    quantization_config; returns the folder."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    temp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    config = model.config
    saved_quantization = config.__dict__.pop("quantization_config", None)
    try:
        plain = AutoModelForCausalLM.from_config(config, dtype=_dtype(model))
    finally:
        if saved_quantization is not None:
            config.quantization_config = saved_quantization
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(temp)
    written = json.loads((temp / "config.json").read_text())
    written.pop("quantization_config", None)
    (temp / "config.json").write_text(json.dumps(written, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    temp.rename(folder)
    return folder


def _dtype(model) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype
