"""The episode loop on a real engine (tiny-llama, patched): how an episode ends (done,
max_turns, max_total_tokens), its return (turn_reward sum / last), reset's own prompt, and
every environment failure counted, scored 0 and ending only its own episode."""

from __future__ import annotations

import time

import pytest

from rl_engine.envs import EpisodeLimits, TurnCodec, episode_metrics, run_episodes
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.envs.scripted import Answer, engine_turns
from tests.helpers.rollout.common import patched_model

VOCAB = 1000
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(patched_model("tiny-llama"), device="cpu", max_batch_size=4)


def play(engine, make_env, *, max_turns=3, max_total_tokens=200, timeout_s=5.0, samples=2,
         turn_reward="sum", max_new_tokens=4, prompts=PROMPTS, codec=None):  # fmt: skip
    sampling = SamplingParams(max_new_tokens=max_new_tokens, seed=11, eos_token_id=None)
    return run_episodes(
        [{"prompt_ids": p, "answer": "7"} for p in prompts],
        samples,
        engine_turns(engine, sampling),
        make_env=make_env,
        codec=codec or TurnCodec(None, VOCAB),
        limits=EpisodeLimits(max_turns, max_total_tokens, timeout_s, turn_reward),
    )


def test_turns_alternate_with_observations_until_done(engine):
    episodes = play(engine, lambda: Answer(length=3, turns=2), max_turns=5)
    assert [(e.prompt_index, e.sample_index) for e in episodes] == [
        (p, s) for p in range(3) for s in range(2)
    ]
    for e in episodes:
        assert e.turns == 2 and e.finish_reason == "done" and not e.truncated
        # turn (4 tokens), observation (3 ids), turn (4 tokens): the last observation is
        # ignored because step said done
        assert e.policy_mask == [True] * 4 + [False] * 3 + [True] * 4
        assert len(e.token_ids) == len(e.logprobs) == 11
        assert e.reward == sum(e.turn_rewards) and len(e.turn_rewards) == 2
    assert play(engine, lambda: Answer(length=3, turns=2), max_turns=5)[3].token_ids == (
        episodes[3].token_ids
    ), "an episode is a function of the seeds"


def test_max_turns_and_the_last_turn_reward(engine):
    summed = play(engine, lambda: Answer(length=1), max_turns=3)
    last = play(engine, lambda: Answer(length=1), max_turns=3, turn_reward="last")
    for s, la in zip(summed, last):
        assert s.turns == 3 and s.finish_reason == "max_turns"
        assert s.token_ids == la.token_ids and s.turn_rewards == la.turn_rewards
        assert s.reward == sum(s.turn_rewards) and la.reward == la.turn_rewards[-1]
    metrics = episode_metrics(summed)
    assert metrics == {
        "env/turns_mean": 3.0,
        "env/multi_turn_fraction": 1.0,
        "env/errors": 0.0,
        "env/timeouts": 0.0,
        "env/truncated": 0.0,
    }


def test_max_total_tokens_cuts_a_turn_and_drops_an_observation(engine):
    # prompt 4 + turn 4 + observation 3 + turn 4 = 15 > 13: the second turn is cut to 2
    cut = play(engine, lambda: Answer(length=3), max_total_tokens=13, prompts=[[5, 6, 7, 8]])
    for e in cut:
        assert e.truncated and e.finish_reason == "truncated" and e.turns == 2
        assert len(e.prompt_ids) + len(e.token_ids) == 13
        assert e.policy_mask == [True] * 4 + [False] * 3 + [True] * 2
    # prompt 4 + turn 4 + observation 20 > 27: the observation is dropped, the episode ends
    dropped = play(engine, lambda: Answer(length=20), max_total_tokens=27, prompts=[[5, 6, 7, 8]])
    for e in dropped:
        assert e.truncated and e.turns == 1 and e.policy_mask == [True] * 4
    assert episode_metrics(cut + dropped)["env/truncated"] == 4.0


class _Fails:
    """Fails where `where` says: init, reset, step, hang (step past its time limit), reward
    (a reward that is not a number), observation (not ids)."""

    def __init__(self, where):
        if where == "init":
            raise OSError("no environment today")
        self.where = where

    def reset(self, record):
        if self.where == "reset":
            raise ValueError("cannot reset")

    def step(self, turn):
        if self.where == "step":
            raise RuntimeError("broken")
        if self.where == "hang":
            time.sleep(60)
        if self.where == "reward":
            return [3], "high", False
        if self.where == "observation":
            return {"ids": [3]}, 0.5, False
        return [3, 4], 1.0, False


@pytest.mark.parametrize(
    ("where", "errors", "timeouts", "turn_rewards", "end"),
    [
        ("init", 1, 0, [], "error"),
        ("reset", 1, 0, [], "error"),
        ("step", 1, 0, [0.0], "error"),
        ("hang", 0, 1, [0.0], "timeout"),
        ("reward", 1, 0, [0.0], "error"),
        ("observation", 1, 0, [0.5], "error"),
    ],
)
def test_a_failing_environment_is_counted_and_ends_only_its_episode(
    engine, where, errors, timeouts, turn_rewards, end
):
    """The first episode's environment fails; every other episode plays on to max_turns."""
    made = iter(range(100))
    started = time.monotonic()
    episodes = play(
        engine, lambda: _Fails(where if next(made) == 0 else "ok"), max_turns=2, timeout_s=0.5
    )
    assert time.monotonic() - started < 30
    first, others = episodes[0], episodes[1:]
    assert (first.env_errors, first.env_timeouts) == (errors, timeouts)
    assert first.turns == 1 and first.turn_rewards == turn_rewards and first.finish_reason == end
    assert first.reward == sum(turn_rewards) and first.policy_mask == [True] * 4
    assert all(o.turns == 2 and o.reward == 2.0 and not o.env_errors for o in others)
    metrics = episode_metrics(episodes)
    assert (metrics["env/errors"], metrics["env/timeouts"]) == (errors, timeouts)


class _OwnPrompt:
    def __init__(self, prompt):
        self.prompt = prompt

    def reset(self, record):
        assert record["answer"] == "7" and record["prompt_ids"]
        return self.prompt

    def step(self, turn):
        return None, 1.0, True


def test_reset_may_give_the_episode_its_own_prompt(engine):
    episodes = play(engine, lambda: _OwnPrompt([20, 21, 22]), samples=1)
    assert all(e.prompt_ids == [20, 21, 22] and not e.env_errors for e in episodes)
    too_long = play(engine, lambda: _OwnPrompt(list(range(3, 60))), max_total_tokens=50)
    assert [e.prompt_ids for e in too_long[::2]] == PROMPTS  # the record's prompt is kept
    assert all(e.env_errors == 1 and e.turns == 1 for e in too_long)


def test_a_prompt_without_room_is_a_config_error(engine):
    with pytest.raises(ValueError, match="rollout.max_total_tokens - 1 = 3"):
        play(engine, lambda: Answer(), max_total_tokens=4)


def test_the_guessing_game_with_text_feedback(engine):
    """GuessNumber on a real tokenizer (word-level, numbers 0..199 are words): every wrong
    guess is answered as a tool message through the chat template, and a turn is scored 1.0
    exactly when its last number is the secret (the record's answer, 7)."""
    from itertools import groupby

    from rl_engine.envs.guess_number import GuessNumber
    from tests.helpers.chat_model import build_tokenizer

    tok = build_tokenizer()
    codec = TurnCodec(tok, VOCAB)
    feedback = [
        codec.observation_ids(text)
        for text in ("Higher.", "Lower.", "Reply with one number from 1 to 100.")
    ]
    episodes = play(engine, lambda: GuessNumber(), max_turns=3, codec=codec, max_new_tokens=6)
    for e in episodes:
        runs = [
            (policy, [t for _, t in run])
            for policy, run in groupby(zip(e.policy_mask, e.token_ids), key=lambda x: x[0])
        ]
        turns = [ids for policy, ids in runs if policy]
        assert [ids for policy, ids in runs if not policy] == [
            feedback[_feedback_kind(codec.text(turn))] for turn in turns[:-1]
        ]
        assert e.turn_rewards == [float(_last_number(codec.text(t)) == 7) for t in turns]
        assert e.turns == len(turns) and (e.turns == 3 or e.finish_reason == "done")
    assert any(not all(e.policy_mask) for e in episodes), "no feedback turn: nothing was tested"


def _last_number(text):
    import re

    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def _feedback_kind(text) -> int:
    guess = _last_number(text)
    return 2 if guess is None else 0 if guess < 7 else 1
