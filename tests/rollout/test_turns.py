"""`RolloutEngine.generate_episodes`: the turn-end hook, continuations in their own slots.

A continuation that keeps only part of its turn (a stop string's cut) prefills from the cut
and is still the whole-transcript turn token for token (fresh `TurnStart` of the same
episode and turn), and the trainer's recompute; the first turn's budget is what is left of
max_total_tokens. The errors: n > 1, a start that is not a TurnStart, a hook that answers
something else, a `kept` or budget out of range, an observation outside the vocabulary, a
hook on a tensor-parallel engine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rl_engine.logprobs import token_logprobs
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.tp import TensorParallelEngine
from rl_engine.rollout.turns import Continuation, TurnStart
from tests.helpers.rollout.common import patched_model, random_prompts

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, eos_token_id=None)


def _engine(max_batch_size: int = 4):
    model = patched_model("tiny-llama", torch.float32)
    return model, RolloutEngine(model, device="cpu", max_batch_size=max_batch_size, progress=False)


def test_a_cut_turn_continues_from_the_cut_and_equals_a_fresh_transcript():
    model, engine = _engine()
    prompts = random_prompts(model.config.vocab_size, (4, 7, 5), seed=2)
    turns: dict[int, list] = {}

    def on_turn_end(index, turn):
        turns.setdefault(index, []).append(turn)
        if len(turns[index]) == 3:
            return None
        kept = 2 + index % 3  # 2, 3 or 4 of the 6 tokens: the rows past the cut are rewritten
        return Continuation([10 + index] * (1 + 4 * index), 6, kept=kept)

    starts = [TurnStart(p, episode=20 + i) for i, p in enumerate(prompts)]
    last = engine.generate_episodes(starts, SAMPLING, on_turn_end, max_total_tokens=64)
    assert engine.last_stats.continuations == 6
    assert [c.token_ids for c in last] == [turns[i][-1].token_ids for i in range(3)]
    for index, played in turns.items():
        for number, turn in enumerate(played, start=1):
            fresh = engine.generate_episodes(
                [TurnStart(turn.prompt_ids, episode=20 + index, turn=number)],
                SAMPLING,
                max_total_tokens=64,
            )[0]
            assert fresh.token_ids == turn.token_ids
            assert torch.equal(fresh.logprobs, turn.logprobs)
            ids = torch.tensor([turn.prompt_ids + turn.token_ids])
            with torch.no_grad():
                trainer = token_logprobs(model, ids)[0, len(turn.prompt_ids) - 1 :]
            assert torch.equal(trainer, turn.logprobs)
        for before, after in zip(played, played[1:]):  # each transcript extends the cut one
            kept = 2 + index % 3
            assert after.prompt_ids[: len(before.prompt_ids) + kept] == (
                before.prompt_ids + before.token_ids[:kept]
            )


def test_the_first_turn_gets_what_is_left_of_max_total_tokens():
    _, engine = _engine()
    out = engine.generate_episodes([TurnStart([5, 6, 7], 0)], SAMPLING, max_total_tokens=5)
    assert len(out[0].token_ids) == 2 and out[0].finish_reason == "length"


def test_errors():
    model, engine = _engine()
    start = [TurnStart([5, 6, 7], 0)]
    with pytest.raises(ValueError, match="n=2"):
        engine.generate_episodes(start, replace(SAMPLING, n=2), max_total_tokens=32)
    with pytest.raises(TypeError, match="must be a TurnStart"):
        engine.generate_episodes([[5, 6, 7]], SAMPLING, max_total_tokens=32)
    with pytest.raises(ValueError, match="max_total_tokens must be an int"):
        engine.generate_episodes(start, SAMPLING, max_total_tokens=1)
    bad_answers = {
        "must return a Continuation or None": [1, 2],
        r"Continuation.kept must be in \[0, 6\]": Continuation([3], 2, kept=7),
        "leaves room for 1 to": Continuation([3], 40),
        "outside the vocabulary": Continuation([model.config.vocab_size], 2),
    }
    for message, answer in bad_answers.items():
        with pytest.raises((TypeError, ValueError), match=message):
            engine.generate_episodes(start, SAMPLING, lambda i, t, a=answer: a, max_total_tokens=32)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        TensorParallelEngine.generate_episodes(
            engine, start, SAMPLING, lambda i, t: None, max_total_tokens=32
        )
