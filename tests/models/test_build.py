"""Models built from a config (rl_engine/models/build.py): transformers' config of a family with
the given fields, a random model of it from torch's global generator (the same seed, the same
weights; another seed, others), a plain copy of a GGUF-style quantized config that leaves the
original untouched, the weightless skeleton of a spec, and Qwen3-MoE's sparse block."""

from __future__ import annotations

import torch

from rl_engine.models import TINY_CONFIGS
from rl_engine.models.build import (
    hf_config,
    meta_skeleton,
    plain_model_like,
    qwen3_moe_block,
    random_model,
)

TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def test_hf_config_is_the_familys_with_the_fields():
    config = hf_config("llama", **TINY_LLAMA)
    assert config.model_type == "llama"
    assert {k: getattr(config, k) for k in TINY_LLAMA} == TINY_LLAMA


def test_random_model_follows_the_global_generator_and_the_dtype():
    config = hf_config("llama", **TINY_LLAMA)
    torch.manual_seed(3)
    first = random_model(config)
    torch.manual_seed(3)
    again = random_model(config, dtype=torch.float32)
    torch.manual_seed(4)
    other = random_model(config)
    weights = dict(first.named_parameters())
    assert weights.keys() == dict(again.named_parameters()).keys()
    assert all(torch.equal(p, weights[n]) for n, p in again.named_parameters())
    # negative control: another seed draws other weights
    assert not all(torch.equal(p, weights[n]) for n, p in other.named_parameters())
    assert first.dtype == torch.get_default_dtype()
    assert random_model(config, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_plain_model_like_drops_the_quantizer_of_a_copy():
    config = hf_config("llama", **TINY_LLAMA)
    config.quantization_config = {"quant_method": "gguf"}
    plain = plain_model_like(config, torch.bfloat16)
    assert not hasattr(plain.config, "quantization_config")
    assert config.quantization_config == {"quant_method": "gguf"}  # the caller's is kept
    assert plain.dtype == torch.bfloat16
    assert plain.config.hidden_size == TINY_LLAMA["hidden_size"]


def test_meta_skeleton_has_the_models_names_and_shapes_and_no_weights():
    skeleton = meta_skeleton("tiny-llama")
    reference = random_model(TINY_CONFIGS["tiny-llama"]())
    shapes = {n: p.shape for n, p in reference.named_parameters()}
    assert {n: p.shape for n, p in skeleton.named_parameters()} == shapes
    assert all(p.is_meta for p in skeleton.parameters())


def test_qwen3_moe_block_routes_a_token_through_its_experts():
    config = TINY_CONFIGS["tiny-qwen3-moe"]()
    block = qwen3_moe_block(config)
    assert type(block).__name__ == "Qwen3MoeSparseMoeBlock"
    hidden = torch.randn(1, 3, config.hidden_size)
    out = block(hidden)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == hidden.shape
