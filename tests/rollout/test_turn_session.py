"""TurnSession: sequences kept in their slots between turns continue by a prefill at their
length, token for token what `generate` gives the whole transcript as a fresh prompt.

Multi-turn episodes (tests/envs/scripted.py's Answer, observations of 1 and 6 ids) through a
session and through the job's whole-transcript turns: the same tokens, masks, finish reasons
and bit-equal logprobs, each equal to the trainer's recompute; the session prefilled fewer
tokens. One turn that mixes a prefill at an offset of 1 token, one of several, a new key
prefilling from 0 in the slot an ended key freed, and decodes of all of them together. The
errors: n > 1, more keys than slots, repeated keys, a weight change under a held cache, a
tensor-parallel engine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rl_engine.envs import EpisodeLimits, TurnCodec, run_episodes
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.tp import TensorParallelEngine
from tests.envs.scripted import Answer, engine_turns
from tests.envs.test_engine_parity import PROMPT_LENGTHS, _policy_logprobs
from tests.rollout.helpers import DENSE_FAMILIES, patched_model, random_prompts

SAMPLING = SamplingParams(max_new_tokens=5, temperature=1.0, seed=7, eos_token_id=2)


def session_turns(session, sampling, prefilled: list[int]):
    """The `generate_turn` of tests/envs/scripted.py's engine_turns on a session (same seeds);
    appends each turn's prefilled token count to `prefilled`."""

    def generate_turn(requests, turn):
        turn_sampling = replace(sampling, n=1, seed=sampling.seed * 1000 + turn)
        out = session.generate([(r.key, r.ids) for r in requests], turn_sampling)
        prefilled.append(session.engine.last_stats.prefill_tokens)
        return out

    return generate_turn


def _episodes(model, generate_turn, observation_length):
    vocab = model.config.vocab_size
    records = [{"prompt_ids": p} for p in random_prompts(vocab, PROMPT_LENGTHS, seed=1)]
    return run_episodes(
        records,
        2,
        generate_turn,
        make_env=lambda: Answer(length=observation_length),
        codec=TurnCodec(None, vocab),
        limits=EpisodeLimits(max_turns=4, max_total_tokens=80, timeout_s=10.0),
    )


def _cases():
    for name in (*DENSE_FAMILIES, "tiny-qwen3-moe"):
        for dtype in (torch.float32, torch.bfloat16):
            kept = name == "tiny-llama"
            yield pytest.param(name, dtype, marks=() if kept else pytest.mark.exhaustive)


@pytest.mark.parametrize("observation_length", [1, 6], ids=["1-token", "6-token"])
@pytest.mark.parametrize("name,dtype", list(_cases()))
def test_episodes_through_a_session_equal_the_whole_transcript_path(
    name, dtype, observation_length
):
    model = patched_model(name, dtype)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    want = _episodes(model, engine_turns(engine, SAMPLING), observation_length)
    session = RolloutEngine(model, device="cpu", progress=False).turn_session(8, 128)
    prefilled: list[int] = []
    got = _episodes(model, session_turns(session, SAMPLING, prefilled), observation_length)
    assert any(e.turns > 1 for e in got), "no episode got past its first turn"
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.policy_mask, a.finish_reason) == (
            b.token_ids,
            b.policy_mask,
            b.finish_reason,
        )
        assert torch.equal(a.logprobs, b.logprobs), (a.prompt_index, a.sample_index)
        trainer, sampled = _policy_logprobs(model, a)
        assert torch.equal(trainer, sampled)
    # turns after the first ran only what followed each slot's rows
    transcripts = sum(len(e.prompt_ids) + len(e.token_ids) for e in got)
    assert len(prefilled) > 1 and sum(prefilled) < transcripts


def test_one_turn_mixes_prefills_at_offsets_a_new_key_and_decodes():
    model = patched_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", progress=False)
    session = engine.turn_session(3, 64)
    a, b, c, d = random_prompts(model.config.vocab_size, (6, 9, 4, 7), seed=3)
    first = session.generate([("a", a), ("b", b), ("c", c)], SAMPLING)
    # "c" ended; "a" gets a 1-token observation, "b" a 5-token one, "d" is new (c's slot)
    second = [
        ("a", a + first[0].token_ids + [5]),
        ("d", d),
        ("b", b + first[1].token_ids + [7, 8, 9, 10, 11]),
    ]
    got = session.generate(second, replace(SAMPLING, seed=8))
    stats = engine.last_stats
    assert stats.prefill_forwards == 1 and stats.prefill_tokens == 2 + len(d) + 6
    want = engine.generate([ids for _, ids in second], replace(SAMPLING, seed=8))
    for x, y in zip(got, want, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert torch.equal(x.logprobs, y.logprobs)
    # a transcript that does not extend its slot's rows prefills from 0, still exact
    again = session.generate([("a", a)], SAMPLING)
    assert engine.last_stats.prefill_tokens == len(a)
    assert again[0].token_ids == first[0].token_ids
    assert torch.equal(again[0].logprobs, first[0].logprobs)


def test_errors():
    model = patched_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", progress=False)
    session = engine.turn_session(2, 32)
    prompts = random_prompts(model.config.vocab_size, (3, 4, 5), seed=4)
    with pytest.raises(ValueError, match="n=2"):
        session.generate([(0, prompts[0])], replace(SAMPLING, n=2))
    with pytest.raises(ValueError, match="needs more than the session's 2 slots"):
        session.generate(list(enumerate(prompts)), SAMPLING)
    with pytest.raises(ValueError, match="distinct"):
        session.generate([(0, prompts[0]), (0, prompts[1])], SAMPLING)
    with pytest.raises(ValueError, match="num_slots must be a positive int"):
        engine.turn_session(0, 32)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        TensorParallelEngine.turn_session(engine, 2, 32)  # its ranks do not check their calls
    session.generate([(0, prompts[0])], SAMPLING)
    engine.load_weights(model.state_dict(), 5)
    with pytest.raises(RuntimeError, match="weight version"):
        session.generate([(0, prompts[0])], SAMPLING)
