"""Hugging Face folders vLLM can load: vLLM reads folders (safetensors + config.json), not the
packaged GGUF or models built in code; it refuses a `quantization_config` (a GGUF-loaded model
keeps `gguf` there although its weights are dense), and its CPU KV cache takes head sizes 32,
64, ... only. Used by the vLLM engine actor, the vLLM benchmark and the vLLM tests.

Imports no vLLM code."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from rl_engine.models.build import plain_model_like, random_model
from rl_engine.models.loading import SMOLLM2_NAME, load_model
from rl_engine.models.tiny import TINY_CONFIGS

# vLLM's CPU KV cache takes head sizes 32, 64, ...; the tiny configs' own are odd on purpose.
VLLM_HEAD_DIM = 32


def write_vllm_folder(model, folder: Path) -> Path:
    """Save `model` (its own tensors, in its own dtype) at `folder`, replaced atomically,
    without a quantization_config: vLLM then serves exactly these weights."""
    folder = Path(folder)
    temp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    plain = plain_model_like(model.config, _dtype(model))
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(temp)
    written = json.loads((temp / "config.json").read_text())
    written.pop("quantization_config", None)
    (temp / "config.json").write_text(json.dumps(written, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    temp.rename(folder)
    return folder


def write_folder(name: str, dtype: torch.dtype, root: Path) -> Path:
    """The tiny model `name` (seed 0, head size 32) saved as a Hugging Face folder."""
    config = TINY_CONFIGS[name]()
    config.head_dim = VLLM_HEAD_DIM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = random_model(config, dtype=torch.float32)
    return write_vllm_folder(model.to(dtype), Path(root) / f"{name}-{_dtype_name(dtype)}")


def write_smollm2_folder(dtype: torch.dtype, root: Path) -> Path:
    """SmolLM2-135M-Instruct (the packaged GGUF, dequantised in fp32, then cast) as a Hugging
    Face folder with its tokenizer."""
    model, tokenizer = load_model(SMOLLM2_NAME, dtype=torch.float32)
    folder = write_vllm_folder(model.to(dtype), Path(root) / f"smollm2-{_dtype_name(dtype)}")
    tokenizer.save_pretrained(folder)
    return folder


def _dtype(model) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
