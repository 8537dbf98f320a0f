"""Hugging Face models built from a config: what export, preflight and the benchmarks need of
transformers, so that outside models/ and patching/ no module imports it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from rl_engine.models.loading import model_config


def hf_config(model_type: str, **fields) -> PretrainedConfig:
    """transformers' config of `model_type` ("llama", "qwen2", "qwen3_moe", ...) with `fields`."""
    return AutoConfig.for_model(model_type, **fields)


def random_model(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The causal LM of `config`, initialised from torch's global generator (in `dtype`, or
    torch's default dtype)."""
    if dtype is None:
        return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def plain_model_like(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """A plain model of the same architecture: one loaded from GGUF carries a quantizer that
    refuses save_pretrained (and would make from_pretrained look for a .gguf file)."""
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        del plain.quantization_config
    return AutoModelForCausalLM.from_config(plain, dtype=dtype)


def meta_skeleton(spec: str | Path) -> PreTrainedModel:
    """The model of `spec` with weightless (meta) parameters: its modules' names and shapes."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(spec))


def qwen3_moe_block(config: PretrainedConfig) -> torch.nn.Module:
    """transformers' Qwen3-MoE sparse block (router + experts) of a qwen3_moe `config`."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(config)
