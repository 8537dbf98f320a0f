"""The tiny configs built in code (rl_engine/models/tiny.py): the odd shapes and the family
differences they promise (tied and untied heads, q/k norms, MoE widths on both experts
implementations and a dense layer), weights a function of the seed alone (bitwise, with a
negative control: another seed), bf16 the rounded fp32 model, the caller's RNG untouched."""

import pytest
import torch

from rl_engine.models import TINY_CONFIGS, load_model
from rl_engine.models.tiny import build_tiny_model

MOE = sorted(name for name in TINY_CONFIGS if "moe" in name or "mixtral" in name)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tied_and_untied_families_both_exist():
    ties = {name: TINY_CONFIGS[name]().tie_word_embeddings for name in TINY_CONFIGS}
    assert any(ties.values()) and not all(ties.values())


def test_tiny_llama_has_the_advertised_odd_shape():
    config = load_model("tiny-llama")[0].config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (1000, 96, 200)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 2, 16)


def test_qwen3_has_qk_norms():
    model, _ = load_model("tiny-qwen3")
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_seed_determines_weights(name):
    a, _ = load_model(name, seed=3)
    b, _ = load_model(name, seed=3)
    c, _ = load_model(name, seed=4)
    assert _same_weights(a, b)
    assert not _same_weights(a, c)


def test_bf16_model_is_the_rounded_fp32_model():
    fp32, _ = load_model("tiny-qwen2", seed=1)
    bf16, _ = load_model("tiny-qwen2", seed=1, dtype=torch.bfloat16)
    for (name, p32), p16 in zip(fp32.state_dict().items(), bf16.state_dict().values(), strict=True):
        assert torch.equal(p32.to(torch.bfloat16), p16), name


def test_loading_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model("tiny-llama", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_moe_widths_cover_both_experts_implementations_and_a_dense_layer():
    impls = {load_model(n, dtype=torch.bfloat16)[0].config._experts_implementation for n in MOE}
    assert impls == {"eager", "grouped_mm"}
    layers = [type(layer.mlp).__name__ for layer in load_model("tiny-qwen3-moe")[0].model.layers]
    assert layers == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]


def test_build_tiny_model_is_what_load_model_returns_and_names_an_unknown_model():
    model = build_tiny_model("tiny-llama", seed=2)
    assert _same_weights(model, load_model("tiny-llama", seed=2)[0])
    assert not _same_weights(model, build_tiny_model("tiny-llama", seed=0))
    with pytest.raises(
        ValueError, match=r"unknown tiny model 'tiny-gpt'; valid names: \['tiny-llama'"
    ):
        build_tiny_model("tiny-gpt")


def test_every_config_shares_the_short_context_and_the_special_ids_and_an_odd_vocabulary():
    for name, build in TINY_CONFIGS.items():
        config = build()
        assert (config.max_position_embeddings, config.bos_token_id, config.eos_token_id) == (
            512,
            1,
            2,
        ), name
        assert config.vocab_size & (config.vocab_size - 1), (
            name
        )  # no power of two: kernels must not rely on one
