"""Speculative decoding keeps every bit: with drafts from prompt lookup or a draft model, the
tokens, logprobs and finish reasons are `torch.equal` to plain decoding's, at every k, dtype,
temperature, top-p / top-k, stop condition and budget cut, inside continuous batching (more
requests than slots: admissions mid-run), in multi-turn episodes and with a LoRA policy. The trainer's recompute
equals them too. Negative control: with a call-order random stream (one per request, as
rejection samplers draw) the draft's draws shift the policy's, and the tokens differ.
"""

from __future__ import annotations

import pytest
import torch

import rl_engine.rollout.speculative.proposers as proposers_module
import rl_engine.rollout.speculative.verify as verify_module
import rl_engine.rollout.stepper as stepper_module
from rl_engine.logprobs import token_logprobs
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.speculative import SpeculationError, SpeculativeParams
from rl_engine.rollout.speculative.ngram import propose_ngram
from rl_engine.rollout.turns import Continuation, TurnStart
from tests.helpers.lora_policy import lora_model
from tests.helpers.rollout.common import (
    DENSE_FAMILIES,
    fresh_model,
    patched_model,
    random_prompts,
    stop_ids,
)

SLOTS = 3  # fewer than the requests: slots free and refill mid-run
SAMPLINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-top-p": dict(temperature=0.7, top_p=0.9, top_k=50),
    "greedy": dict(temperature=0.0),
}


def _prompts(vocab: int) -> list[list[int]]:
    """Random prompts, and two that repeat a phrase (prompt lookup has drafts to offer)."""
    return random_prompts(vocab, (5, 17, 9, 30), seed=0) + [[7, 8, 9, 10] * 6, [11, 12] * 9]


def _generate(model, prompts, sampling, **speculation):
    engine = RolloutEngine(model, device="cpu", max_batch_size=SLOTS, progress=False, **speculation)
    return engine.generate(prompts, sampling), engine.last_stats


def assert_same(plain, speculated):
    for a, b in zip(plain, speculated, strict=True):
        assert a.token_ids == b.token_ids, (a.prompt_index, a.sample_index)
        assert torch.equal(a.logprobs, b.logprobs), (a.prompt_index, a.sample_index)
        assert a.finish_reason == b.finish_reason


def _sampling(name: str, vocab: int, **extra) -> SamplingParams:
    stops = stop_ids(vocab, 8)  # some completions stop early, the rest at the cut
    return SamplingParams(
        max_new_tokens=20, n=2, seed=1, stop_token_ids=stops, **SAMPLINGS[name], **extra
    )


def _speculation(method: str, k: int, dtype: torch.dtype, family: str = "tiny-llama") -> dict:
    if method == "ngram":  # 1-token suffixes too: a random model's text seldom repeats two
        return {"speculative": SpeculativeParams(method="ngram", num_tokens=k, ngram_min=1)}
    params = SpeculativeParams(method="draft_model", num_tokens=k)
    draft = patched_model(family, dtype, seed=0 if method == "draft-self" else 1)
    return {"speculative": params, "draft_model": draft}


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("method", ["ngram", "draft-other", "draft-self"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculation_equals_plain_decoding(dtype, method, k):
    model = patched_model("tiny-llama", dtype)
    prompts = _prompts(model.config.vocab_size)
    admitted = 0
    for name in ("t1", "t0.7-top-p"):
        sampling = _sampling(name, model.config.vocab_size)
        plain, plain_stats = _generate(model, prompts, sampling)
        speculated, stats = _generate(model, prompts, sampling, **_speculation(method, k, dtype))
        assert_same(plain, speculated)
        admitted += stats.admitted_while_running
        counts = stats.speculation
        assert counts.forwards == stats.decode_forwards and counts.proposed > 0
        if method == "draft-self":  # the same distribution and the same uniforms: all accepted
            assert counts.proposed > 0 and counts.accepted == counts.proposed
            assert stats.decode_forwards < plain_stats.decode_forwards
    assert plain_stats.speculation is None
    assert admitted > 0, "no request was admitted while others ran"


@pytest.mark.parametrize("family", [*DENSE_FAMILIES[1:], "tiny-qwen3-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_family_speculates_exactly(family, dtype):
    model = patched_model(family, dtype)
    prompts = _prompts(model.config.vocab_size)
    sampling = _sampling("t1", model.config.vocab_size)
    plain, _ = _generate(model, prompts, sampling)
    for method in ("ngram", "draft-other"):
        speculated, _ = _generate(
            model, prompts, sampling, **_speculation(method, 3, dtype, family)
        )
        assert_same(plain, speculated)


def test_only_small_batches_speculate():
    """max_batch: decode steps of more sequences decode one token each; the same bits."""
    model = patched_model("tiny-llama", torch.float32)
    prompts = _prompts(model.config.vocab_size)
    sampling = _sampling("t1", model.config.vocab_size)
    plain, _ = _generate(model, prompts, sampling)
    params = SpeculativeParams(method="draft_model", num_tokens=3, max_batch=2)
    draft = patched_model("tiny-llama", torch.float32)
    out, stats = _generate(model, prompts, sampling, speculative=params, draft_model=draft)
    assert_same(plain, out)
    small = sum(b <= 2 for b in stats.batch_sizes)
    assert 0 < stats.speculation.forwards == small < stats.decode_forwards


def test_the_trainer_recomputes_the_speculated_logprobs():
    model = patched_model("tiny-llama", torch.float32)
    sampling = _sampling("t0.7-top-p", model.config.vocab_size)
    out, _ = _generate(
        model,
        _prompts(model.config.vocab_size),
        sampling,
        **_speculation("draft-self", 3, torch.float32),
    )
    for c in out:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            trainer = token_logprobs(model, ids, temperature=0.7)[0, len(c.prompt_ids) - 1 :]
        assert torch.equal(trainer, c.logprobs)


def test_a_repetitive_text_accepts_most_drafts():
    """Greedy decoding of a repeated phrase: prompt lookup's drafts are the continuation."""
    model = patched_model("tiny-llama", torch.float32)
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0)
    prompts = [[7, 8, 9, 10] * 6]
    plain, _ = _generate(model, prompts, sampling)
    out, stats = _generate(model, prompts, sampling, **_speculation("ngram", 7, torch.float32))
    assert_same(plain, out)
    assert stats.speculation.accept_rate > 0.5
    assert stats.speculation.tokens_per_forward > 2.0


def test_a_multi_turn_episode_speculates_exactly():
    model = patched_model("tiny-llama", torch.float32)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    prompts = random_prompts(model.config.vocab_size, (4, 7, 5), seed=2)

    def play(**speculation):
        engine = RolloutEngine(model, device="cpu", max_batch_size=2, progress=False, **speculation)
        turns: dict[int, list] = {}

        def on_turn_end(index, turn):
            turns.setdefault(index, []).append(turn)
            return None if len(turns[index]) == 3 else Continuation([10 + index] * 5, 6, kept=4)

        starts = [TurnStart(p, episode=i) for i, p in enumerate(prompts)]
        engine.generate_episodes(starts, sampling, on_turn_end, max_total_tokens=64)
        return [t for i in sorted(turns) for t in turns[i]]

    plain = play()
    assert_same(plain, play(**_speculation("draft-self", 3, torch.float32)))
    assert_same(plain, play(**_speculation("ngram", 3, torch.float32)))


def test_a_lora_policy_speculates_exactly():
    model = lora_model("tiny-llama")
    apply_batch_invariant(model)
    prompts = _prompts(model.config.vocab_size)
    sampling = _sampling("t1", model.config.vocab_size)
    plain, _ = _generate(model, prompts, sampling)
    for method in ("ngram", "draft-other"):
        speculated, stats = _generate(
            model, prompts, sampling, **_speculation(method, 3, torch.float32)
        )
        assert_same(plain, speculated)
        assert stats.speculation.proposed > 0


def _call_order_stream(monkeypatch):
    """One stream per request, read in call order (the index is ignored): what a sampler
    built on a per-request torch.Generator does."""
    calls: dict[int, int] = {}

    def uniform(key: int, index: int) -> float:
        calls[key] = calls.get(key, 0) + 1
        return torch.rand(1, generator=torch.Generator().manual_seed(key + calls[key])).item()

    for module in (stepper_module, verify_module, proposers_module):
        monkeypatch.setattr(module, "token_uniform", uniform)
    return calls


def test_a_call_order_stream_breaks_the_equality(monkeypatch):
    model = patched_model("tiny-llama", torch.float32)
    prompts = _prompts(model.config.vocab_size)
    sampling = _sampling("t1", model.config.vocab_size)
    calls = _call_order_stream(monkeypatch)
    plain, _ = _generate(model, prompts, sampling)
    calls.clear()
    speculated, _ = _generate(
        model, prompts, sampling, **_speculation("draft-other", 3, torch.float32)
    )
    assert [c.token_ids for c in plain] != [c.token_ids for c in speculated]


def test_prompt_lookup_proposes_the_continuation_of_the_latest_full_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3, 1) == [8, 1]
    assert propose_ngram([5, 5, 5, 5, 5, 5], 3, 2, 1) == [5, 5, 5]
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []
    assert propose_ngram([4, 7, 1, 4], 2, 3, 1) == [7, 1]  # falls back to n = 1


def test_speculation_is_refused_where_it_cannot_keep_the_bits():
    model = patched_model("tiny-llama", torch.float32)
    ngram = SpeculativeParams(method="ngram", num_tokens=2)
    draft = SpeculativeParams(method="draft_model", num_tokens=2)
    cases = {
        "patched": dict(model=fresh_model("tiny-llama", patched=False), speculative=ngram),
        "needs draft_model": dict(speculative=draft),
        "vocabulary": dict(speculative=draft, draft_model=patched_model("tiny-qwen2")),
        "must be patched": dict(
            speculative=draft, draft_model=fresh_model("tiny-llama", patched=False)
        ),
        "without speculative": dict(draft_model=model),
    }
    for message, kwargs in cases.items():
        policy = kwargs.pop("model", model)
        with pytest.raises(SpeculationError, match=message):
            RolloutEngine(policy, device="cpu", progress=False, **kwargs)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"method": "medusa", "num_tokens": 2}, "rollout.speculative.method"),
        ({"method": "ngram", "num_tokens": 0}, "rollout.speculative.num_tokens"),
        ({"method": "ngram"}, "rollout.speculative.num_tokens is required"),
        ({"method": "draft_model", "num_tokens": 2}, "rollout.speculative.model is required"),
        ({"method": "ngram", "num_tokens": 2, "ngram_min": 3, "ngram_max": 2}, "ngram_max"),
        ({"method": "ngram", "num_tokens": 2, "k": 2}, "unknown key rollout.speculative.k"),
        ({"method": "ngram", "num_tokens": 2, "max_batch": 0}, "rollout.speculative.max_batch"),
    ],
)
def test_bad_speculative_keys_are_named(data, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeParams.from_dict(data)
