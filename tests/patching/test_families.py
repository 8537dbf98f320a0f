"""Which Hugging Face architectures can be patched (patching/families.py).

What it checks: every supported `model_type` maps to its family (the MoE ones with their
routing spec); `family_for` refuses, naming the value and the fix, an unknown model_type
(listing the supported ones), an activation other than SiLU, a sliding window that is used
(qwen2/qwen3 carry a window they do not use unless use_sliding_window), and router jitter
noise; `apply_batch_invariant` refuses such models before changing anything.
"""

import pytest
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

from rl_engine.models import load_model
from rl_engine.patching import FAMILIES, apply_batch_invariant, family_for


def _model(name):
    """An unpatched tiny model."""
    model, _ = load_model(name, seed=0)
    return model


def test_unsupported_architecture_lists_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(
        NotImplementedError,
        match="supported: llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe",
    ):
        apply_batch_invariant(model)


def test_sliding_window_is_rejected():
    model = _model("tiny-mistral")  # unpatched
    model.config.sliding_window = 16
    with pytest.raises(NotImplementedError, match="sliding-window"):
        apply_batch_invariant(model)


def test_every_supported_model_type_has_its_family():
    assert sorted(FAMILIES) == [
        "llama",
        "mistral",
        "mixtral",
        "olmoe",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
    ]
    assert family_for(LlamaConfig()).moe is None
    mixtral = family_for(MixtralConfig(router_jitter_noise=0.0)).moe
    assert mixtral.renormalize is True and mixtral.weights_in_model_dtype is False
    assert FAMILIES["qwen2_moe"].moe.shared_expert and not FAMILIES["qwen3_moe"].moe.shared_expert


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (LlamaConfig(hidden_act="gelu"), r"llama: hidden_act 'gelu' is not supported"),
        (
            MistralConfig(sliding_window=16, max_position_embeddings=64),
            r"mistral: sliding-window attention \(sliding_window=16\).*set config.sliding_window = None",
        ),
        (
            Qwen2Config(sliding_window=16, use_sliding_window=True),
            r"qwen2: sliding-window attention \(sliding_window=16\)",
        ),
        (
            MixtralConfig(router_jitter_noise=0.1),
            r"mixtral: router_jitter_noise=0.1 .* set config.router_jitter_noise = 0",
        ),
    ],
    ids=["activation", "mistral-window", "qwen2-window", "jitter"],
)
def test_a_config_the_invariant_ops_cannot_follow_is_named(config, match):
    with pytest.raises(NotImplementedError, match=match):
        family_for(config)


def test_a_window_that_is_never_used_or_covers_every_position_is_accepted():
    assert (
        family_for(Qwen2Config(sliding_window=16, use_sliding_window=False)).model_type == "qwen2"
    )
    wide = MistralConfig(sliding_window=64, max_position_embeddings=64)
    assert family_for(wide).model_type == "mistral"
