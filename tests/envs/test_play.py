"""Episodes played inside the engine's continuous batching (`play_episodes`) are exact and a
function of the seeds alone.

The chain: a continued turn is a prefill at the slot's length of [the last sampled token, the
observation] while other episodes decode (scheduler.py); the invariant attention gives a
prefill at an offset the bits of a full prefill and of decode, and every other op is row-wise,
therefore every policy token's logprob == the trainer's `token_logprobs` of the whole
transcript (prompt, turns, observations), torch.equal. `GenerateStats` shows that episodes
continued while others were decoding, so the layout the contract is about really ran.

Each turn draws from the generator of (seed, episode, turn): the same episodes (tokens, masks,
logprobs) with 2 slots and with 8, played by one engine or split over two, and through the
whole-transcript path (`run_episodes` + `transcript_turns`: every turn a fresh prompt).
Observations of 1 id and of 6 in the same run (tests/helpers/envs/scripted.py's Mixed). Negative
control: the plain (unpatched) engine's continued episodes differ from the recompute.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.envs import (
    EpisodeLimits,
    TurnCodec,
    episode_tasks,
    play_episodes,
    run_episodes,
    transcript_turns,
)
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.envs.scripted import Mixed
from tests.helpers.envs.transcripts import PROMPT_LENGTHS, policy_logprobs
from tests.helpers.invariance import run_with_threads
from tests.helpers.rollout.common import DENSE_FAMILIES, fresh_model, patched_model, random_prompts

# turns end at a stop token about one time in six: of different lengths, so episodes continue
# while others decode
STOPS = tuple(range(100, 100 + 1000 // 6))
SAMPLING = SamplingParams(
    max_new_tokens=5, temperature=1.0, seed=7, eos_token_id=2, stop_token_ids=STOPS
)
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=48, timeout_s=10.0)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _records(vocab: int) -> list[dict]:
    return [{"prompt_ids": p} for p in random_prompts(vocab, PROMPT_LENGTHS, seed=1)]


def _play(model, tasks, max_batch_size: int = 3):
    """(the episodes of `tasks` played on one engine, its GenerateStats)."""
    engine = RolloutEngine(model, device="cpu", max_batch_size=max_batch_size, progress=False)
    vocab = model.config.vocab_size
    episodes = play_episodes(
        engine, tasks, SAMPLING, make_env=Mixed, codec=TurnCodec(None, vocab), limits=LIMITS
    )
    return episodes, engine.last_stats


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.prompt_index, x.sample_index) == (y.prompt_index, y.sample_index)
        assert (x.token_ids, x.policy_mask, x.finish_reason) == (
            y.token_ids,
            y.policy_mask,
            y.finish_reason,
        )
        assert torch.equal(x.logprobs, y.logprobs), (x.prompt_index, x.sample_index)


def _cases():
    for name in (*DENSE_FAMILIES, "tiny-qwen3-moe"):
        for dtype in DTYPES:
            kept = name in ("tiny-llama", "tiny-qwen3-moe")
            yield pytest.param(name, dtype, marks=() if kept else pytest.mark.exhaustive)


@pytest.mark.parametrize("name,dtype", list(_cases()))
def test_continued_episodes_equal_the_recompute_of_the_whole_transcript(name, dtype):
    model = patched_model(name, DTYPES[dtype])
    episodes, stats = _play(model, episode_tasks(_records(model.config.vocab_size), 2))
    assert len(episodes) == 8
    assert stats.continuations > 0 and stats.continued_while_running > 0, stats
    observed = [e.policy_mask.count(False) for e in episodes if e.turns > 1]
    assert observed, "no episode got past its first turn"
    lengths = {
        n for e in episodes for n in _runs(e.policy_mask, False)
    }  # observation lengths that ran
    assert {1, 6} <= lengths, lengths
    for e in episodes:
        trainer, sampled = policy_logprobs(model, e)
        assert trainer.dtype == sampled.dtype == torch.float32
        assert torch.equal(trainer, sampled), (name, dtype, e.prompt_index, e.sample_index)
        assert bool((e.logprobs[~torch.tensor(e.policy_mask)] == 0).all())


def _runs(mask: list[bool], value: bool) -> list[int]:
    """Lengths of the runs of `value` in `mask`."""
    runs, n = [], 0
    for m in [*mask, not value]:
        if m == value:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_episodes_depend_on_neither_slots_nor_engines_nor_the_path(dtype):
    """2 slots == 8 slots == split over two engines == every turn a fresh whole transcript."""
    model = patched_model("tiny-llama", DTYPES[dtype])
    tasks = episode_tasks(_records(model.config.vocab_size), 2)
    two, _ = _play(model, tasks, max_batch_size=2)
    eight, _ = _play(model, tasks, max_batch_size=8)
    _same(two, eight)
    # engine k plays the prompts p with p % 2 == k (the job's split)
    shares = [[t for t in tasks if t.prompt_index % 2 == k] for k in range(2)]
    split = {}
    for share in shares:
        played, _ = _play(model, share)
        split.update((t.key, e) for t, e in zip(share, played))
    _same(two, [split[t.key] for t in tasks])
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)

    def play_turns(starts, sampling, max_total_tokens):
        return engine.generate_episodes(starts, sampling, max_total_tokens=max_total_tokens)

    whole = run_episodes(
        [t.record for t in tasks[::2]],
        2,
        transcript_turns(play_turns, SAMPLING, LIMITS),
        make_env=Mixed,
        codec=TurnCodec(None, model.config.vocab_size),
        limits=LIMITS,
    )
    _same(two, whole)
    assert engine.last_stats.continuations == 0  # every turn was a fresh prompt


def test_negative_control_the_plain_engine_differs():
    """The same episodes played by an unpatched engine (plain cached SDPA, its own lm_head):
    its logprobs are not the patched trainer's recompute on every token."""
    plain = fresh_model("tiny-llama", torch.float32, patched=False)
    episodes, stats = _play(plain, episode_tasks(_records(plain.config.vocab_size), 2))
    assert stats.continued_while_running > 0
    trainer_model = patched_model("tiny-llama", torch.float32)
    pairs = [policy_logprobs(trainer_model, e) for e in episodes]
    trainer = torch.cat([t for t, _ in pairs])
    sampled = torch.cat([s for _, s in pairs])
    fraction = (trainer == sampled).float().mean().item()
    print(f"\nplain tiny-llama fp32, continued episodes: {fraction:.1%} of policy tokens equal")
    assert fraction < 1.0


THREADS_SNIPPET = """
from rl_engine.envs import episode_tasks
from tests.envs.test_play import _play, _records
from tests.helpers.rollout.common import patched_model
import torch

model = patched_model("{name}", torch.{dtype})
episodes, _ = _play(model, episode_tasks(_records(model.config.vocab_size), 2))
result = [(e.token_ids, e.policy_mask, e.logprobs) for e in episodes]
"""


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize(
    "name,dtype",
    [
        ("tiny-llama", "float32"),
        pytest.param("tiny-qwen3-moe", "bfloat16", marks=pytest.mark.exhaustive),
    ],
)
def test_continued_episodes_at_two_threads_equal_those_at_one(name, dtype):
    """Played at 2 intra-op threads (a worker process) and at 1: the same episodes, bit for bit."""
    code = THREADS_SNIPPET.format(name=name, dtype=dtype)
    one, two = run_with_threads(code, 1), run_with_threads(code, 2)
    assert len(one) == len(two) == 8
    for (t1, m1, l1), (t2, m2, l2) in zip(one, two):
        assert (t1, m1) == (t2, m2) and torch.equal(l1, l2)
