"""Hugging Face folders vLLM can load: vLLM reads folders (not the packaged GGUF), and its CPU
KV cache takes head sizes 32, 64, ... only. Used by the vLLM benchmark and the vLLM tests.

Imports no vLLM code."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rl_engine.models.loading import SMOLLM2_NAME, load_model
from rl_engine.models.tiny import TINY_CONFIGS

# vLLM's CPU KV cache takes head sizes 32, 64, ...; the tiny configs' own are odd on purpose.
VLLM_HEAD_DIM = 32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_folder(name: str, dtype: torch.dtype, root: Path) -> Path:
    """The tiny model `name` (seed 0, head size 32) saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS[name]()
    config.head_dim = VLLM_HEAD_DIM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = Path(root) / f"{name}-{_dtype_name(dtype)}"
    model.to(dtype).save_pretrained(folder)
    return folder


def write_smollm2_folder(dtype: torch.dtype, root: Path) -> Path:
    """SmolLM2-135M-Instruct (the packaged GGUF, dequantised) as a Hugging Face folder with its
    tokenizer: vLLM loads folders, and refuses the GGUF's `quantization_config`."""
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = load_model(SMOLLM2_NAME, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    folder = Path(root) / f"smollm2-{_dtype_name(dtype)}"
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    return folder
