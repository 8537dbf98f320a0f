"""Engine plumbing: input validation, output order, invariance-off mode (the KV cache: test_kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.patching import attention_name, is_patched
from rl_engine.patching.attention import PLAIN_CACHED_NAME
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout import engine as engine_module
from tests.helpers.rollout.common import fresh_model, patched_model, random_prompts

VOCAB = 1000  # tiny-llama


def _engine(**kwargs):
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    return RolloutEngine(patched_model("tiny-llama"), **kwargs)


def test_empty_prompt_list_gives_empty_result():
    assert _engine().generate([], SamplingParams()) == []


def test_output_is_prompt_major_and_complete():
    prompts = [
        torch.tensor(p) for p in random_prompts(VOCAB, (3, 7, 2), seed=1)
    ]  # 1-D tensors work too
    completions = _engine(max_batch_size=2).generate(prompts, SamplingParams(max_new_tokens=5, n=2))
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (p, s) for p in range(3) for s in range(2)
    ]
    for c in completions:
        assert c.prompt_ids == prompts[c.prompt_index].tolist()
        assert len(c.token_ids) == 5 and c.finish_reason == "length" and c.weight_version == 0
        assert c.logprobs.dtype == torch.float32 and bool((c.logprobs <= 0).all())


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[5, 6], []], r"prompt 1 is empty"),
        ([[5, 6], [7, 1000]], r"prompt 1 has token id 1000"),
        ([[-1]], r"prompt 0 has token id -1"),
        (
            [[5, 6], [5] * 30],
            r"prompt 1: 30 prompt tokens \+ max_new_tokens 8 = 38 > max_seq_len 32",
        ),
        ([[5, 6.0]], r"prompt 0 has a non-integer token id"),
        ([torch.ones(2, 2, dtype=torch.long)], r"prompt 0 must be a 1-D integer tensor"),
        (["hello"], r"prompt 0 must be a list of token ids"),
        (torch.ones(2, 3, dtype=torch.long), r"prompts must be a list"),
    ],
)
def test_bad_prompts_raise_naming_the_prompt(prompts, match):
    with pytest.raises(ValueError, match=match):
        _engine(max_seq_len=32).generate(prompts, SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"device": "meta"}, "device"),
        ({"weight_version": "v1"}, "version"),
    ],
)
def test_bad_engine_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _engine(**kwargs)


def test_device_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="device must be a str or torch.device"):
        _engine(device=3)


@pytest.mark.parametrize(("temperature", "expected"), [(0.0, 1.0), (0.7, 0.7), (1.0, 1.0)])
def test_completions_carry_their_logprob_temperature(temperature, expected):
    """Greedy decoding records T = 1 logprobs; sampling records them at its own temperature."""
    sampling = SamplingParams(max_new_tokens=2, temperature=temperature, n=2, seed=1)
    completions = _engine(weight_version=4).generate(random_prompts(VOCAB, (3,), seed=2), sampling)
    assert {(c.logprob_temperature, c.weight_version) for c in completions} == {(expected, 4)}


def test_default_max_seq_len_is_the_models():
    assert _engine().max_seq_len == patched_model("tiny-llama").config.max_position_embeddings


def test_unpatched_model_runs_plain_cached_attention_and_is_restored():
    model = fresh_model("tiny-llama", patched=False)
    before = model.config._attn_implementation
    seen = []
    engine = RolloutEngine(model, device="cpu", max_batch_size=2, progress=False)
    assert not engine.batch_invariant
    original = engine_module.Stepper.decode

    def watch(self, seqs):
        seen.append(model.config._attn_implementation)
        return original(self, seqs)

    engine_module.Stepper.decode = watch
    try:
        completions = engine.generate(
            random_prompts(VOCAB, (4, 6, 2), seed=2), SamplingParams(max_new_tokens=4)
        )
    finally:
        engine_module.Stepper.decode = original
    assert set(seen) == {PLAIN_CACHED_NAME} and model.config._attn_implementation == before
    assert all(len(c.token_ids) == 4 for c in completions)


def test_attention_is_restored_when_generation_fails(monkeypatch):
    model = fresh_model("tiny-llama", patched=False)
    before = model.config._attn_implementation

    def boom(self, seqs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine_module.Stepper, "decode", boom)
    with pytest.raises(RuntimeError, match="boom"):
        RolloutEngine(model, device="cpu", progress=False).generate(
            [[5, 6]], SamplingParams(max_new_tokens=3)
        )
    assert model.config._attn_implementation == before


def test_plain_cached_attention_matches_a_full_forward_closely():
    # invariance off is not bitwise, but it must be the same model: greedy tokens agree with a
    # plain HF forward and logprobs agree to float tolerance
    model = fresh_model("tiny-llama", patched=False)
    prompts = random_prompts(VOCAB, (5, 9), seed=4)
    completions = RolloutEngine(model, device="cpu", progress=False).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0.0)
    )
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0, :-1]
        ref = logp[len(c.prompt_ids) - 1 :].gather(-1, ids[0, len(c.prompt_ids) :, None])[:, 0]
        torch.testing.assert_close(c.logprobs, ref, rtol=0, atol=1e-4)


def test_patched_model_keeps_its_invariant_attention():
    model = patched_model("tiny-llama")
    assert is_patched(model)
    _engine().generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert model.config._attn_implementation == attention_name("cpp")


def test_progress_bar_can_be_enabled(capsys):
    _engine().generate([[5, 6]], SamplingParams(max_new_tokens=2), progress=True)
    assert "rollout" in capsys.readouterr().err
