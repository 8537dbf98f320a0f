"""Tiny, randomly initialised causal-LM configs built in code.

No model hub is reachable, so tests, examples and benchmarks use these small
configs of real Hugging Face families. The sizes are deliberately odd (vocab
1000, hidden 96, head_dim 24, ...) so that kernels cannot rely on powers of two,
and the families differ where the patching layer has to care: tied vs. untied
LM head, q/k norms (Qwen3), q/k/v biases (Qwen2), grouped-query attention.
The mixture-of-experts configs differ in expert count, top-k, renormalisation
and layout: Qwen3-MoE with a dense middle layer (`mlp_only_layers`), Qwen2-MoE
with a shared expert and every other layer dense (`decoder_sparse_step=2`),
Mixtral (fp32 routing weights), OLMoE (full-width q/k norms, clipped q/k/v),
and expert widths (44, 36, 52, 56) of which 44, 36 and 52 are no multiple of 8:
HF's default `grouped_mm` cannot run those in bf16 on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Shared by every tiny config: short context, ids 1/2 as bos/eos inside every vocab.
_COMMON = {
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attn_implementation": "sdpa",
}


@dataclass(frozen=True, slots=True)
class _TinyShape:
    """One tiny config: its family's config class and the sizes that make it odd."""

    family: type[PretrainedConfig]
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None  # None: hidden // heads
    tied: bool
    extra: dict = field(default_factory=dict)

    def build(self) -> PretrainedConfig:
        head_dim = {} if self.head_dim is None else {"head_dim": self.head_dim}
        return self.family(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tied,
            **head_dim,
            **self.extra,
            **_COMMON,
        )


# Qwen2 always has q/k/v biases and, like the larger Qwen2 models, an untied head.
# Qwen3's head_dim is independent of hidden_size (4 * 24 != 80 on purpose).
# Mistral's sliding_window=None: full causal attention, like every other tiny config.
_NO_WINDOW = {"use_sliding_window": False}
# Mixture of experts: (experts, top-k) and the expert width ("intermediate" is the dense MLP's).
_QWEN3_MOE = {
    **_NO_WINDOW,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 44,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
}
_QWEN2_MOE = {
    **_NO_WINDOW,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 36,
    "shared_expert_intermediate_size": 72,
    "decoder_sparse_step": 2,
}
_MIXTRAL = {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}
_OLMOE = {"num_experts": 12, "num_experts_per_tok": 3, "clip_qkv": 6.0}
# fmt: off
_SHAPES = {
    #              family         vocab  hidden inter layers heads kv  head_dim tied
    "tiny-llama":   _TinyShape(LlamaConfig, 1000, 96, 200, 2, 6, 2, 16, True),
    "tiny-qwen2":   _TinyShape(Qwen2Config, 1031, 128, 344, 3, 4, 2, None, False, _NO_WINDOW),
    "tiny-qwen3":   _TinyShape(Qwen3Config, 999, 80, 168, 2, 4, 2, 24, True, _NO_WINDOW),
    "tiny-mistral": _TinyShape(MistralConfig, 1500, 192, 264, 3, 8, 4, 24, False,
                               {"sliding_window": None}),
    "tiny-qwen3-moe": _TinyShape(Qwen3MoeConfig, 997, 80, 168, 3, 4, 2, 24, True, _QWEN3_MOE),
    "tiny-qwen2-moe": _TinyShape(Qwen2MoeConfig, 1031, 96, 200, 4, 4, 2, None, False, _QWEN2_MOE),
    "tiny-mixtral":   _TinyShape(MixtralConfig, 1500, 112, 56, 2, 4, 2, 28, False, _MIXTRAL),
    "tiny-olmoe":     _TinyShape(OlmoeConfig, 1013, 64, 52, 2, 4, 4, None, False, _OLMOE),
}
# fmt: on

TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    name: shape.build for name, shape in _SHAPES.items()
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
