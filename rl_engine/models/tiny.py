"""Tiny, randomly initialised causal-LM configs built in code.

No model hub is reachable, so tests, examples and benchmarks use these small
configs of real Hugging Face families. The sizes are deliberately odd (vocab
1000, hidden 96, head_dim 24, ...) so that kernels cannot rely on powers of two,
and the families differ where the patching layer has to care: tied vs. untied
LM head, q/k norms (Qwen3), q/k/v biases (Qwen2), grouped-query attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

# Shared by every tiny config: short context, ids 1/2 as bos/eos inside every vocab.
_COMMON = {
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attn_implementation": "sdpa",
}


def _tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1000,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        **_COMMON,
    )


def _tiny_qwen2() -> Qwen2Config:
    # Qwen2 always has q/k/v biases; untied head like the larger Qwen2 models.
    return Qwen2Config(
        vocab_size=1031,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        use_sliding_window=False,
        **_COMMON,
    )


def _tiny_qwen3() -> Qwen3Config:
    # head_dim is independent of hidden_size in Qwen3 (4 * 24 != 80 on purpose).
    return Qwen3Config(
        vocab_size=999,
        hidden_size=80,
        intermediate_size=168,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **_COMMON,
    )


def _tiny_mistral() -> MistralConfig:
    # sliding_window=None: full causal attention, like every other tiny config.
    return MistralConfig(
        vocab_size=1500,
        hidden_size=192,
        intermediate_size=264,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=24,
        sliding_window=None,
        tie_word_embeddings=False,
        **_COMMON,
    )


TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-mistral": _tiny_mistral,
}


def build_tiny_model(
    name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> PreTrainedModel:
    """Randomly initialise the tiny model `name`; the same seed gives the same weights.

    Weights are drawn in fp32 and then cast, so a bf16 model is exactly the
    rounded fp32 model of the same seed. The caller's global RNG state is left
    untouched.
    """
    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {name!r}; valid names: {sorted(TINY_CONFIGS)}")
    config = TINY_CONFIGS[name]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype=dtype)
