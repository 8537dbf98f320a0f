"""Multi-turn episodes on the real engine are exact: every token the policy sampled has the
logprob the trainer recomputes teacher-forced over the whole transcript, bit for bit.

The chain: each turn is a `generate` call whose prompt is the whole transcript so far
(prompt, earlier turns, observations), so the turn's first token is scored by a prefill of
the transcript and the rest by decode steps, in whatever batch continuous batching made;
prefill is batch-invariant and prefill == decode, therefore engine == the trainer's
`token_logprobs` of prompt + every turn + every observation. Observations of 1 id and of
many, and a scheduler of 3 slots for 8 episodes (episodes of different lengths prefill and
decode beside each other). Negative control: the plain (unpatched) engine differs.

The acceptance matrix: the four dense families and one MoE family, fp32 and bf16, episodes
sampled at 1 and at 2 intra-op threads (a worker process each) and recomputed by the trainer in
this process, observations of 1 id and of 6. make test keeps tiny-llama fp32 and bf16 in this
process, one thread-count case and the plain engine on tiny-llama fp32; the rest is exhaustive.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.envs import EpisodeLimits, TurnCodec, run_episodes
from rl_engine.logprobs import token_logprobs
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.envs.scripted import Answer, engine_turns
from tests.helpers.invariance import run_with_threads
from tests.helpers.rollout.common import DENSE_FAMILIES, fresh_model, patched_model, random_prompts

PROMPT_LENGTHS = (5, 11, 3, 8)
FAMILIES = (*DENSE_FAMILIES, "tiny-qwen3-moe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OBSERVATION_LENGTHS = {"1-token": 1, "6-token": 6}


def _episodes(model, observation_length: int, *, seed: int = 7):
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    vocab = model.config.vocab_size
    records = [{"prompt_ids": p} for p in random_prompts(vocab, PROMPT_LENGTHS, seed=1)]
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=seed, eos_token_id=2)
    return run_episodes(
        records,
        2,
        engine_turns(engine, sampling),
        make_env=lambda: Answer(length=observation_length),
        codec=TurnCodec(None, vocab),
        limits=EpisodeLimits(max_turns=4, max_total_tokens=80, timeout_s=10.0),
    )


def _policy_logprobs(model, episode) -> tuple[torch.Tensor, torch.Tensor]:
    """(the trainer's recompute of the whole transcript, the engine's) at the policy's tokens."""
    ids = torch.tensor([episode.prompt_ids + episode.token_ids])
    with torch.no_grad():
        trainer = token_logprobs(model, ids)[0, len(episode.prompt_ids) - 1 :]  # (len(tokens),)
    mask = torch.tensor(episode.policy_mask)
    return trainer[mask], episode.logprobs[mask]


def sampled_episodes(name: str, dtype: str, observation_length: int) -> list[tuple]:
    """The episodes of the patched `name` in `dtype` ('fp32' or 'bf16'), as plain values
    (prompt_ids, token_ids, policy_mask, logprobs, turns): what a thread-count worker returns."""
    episodes = _episodes(patched_model(name, DTYPES[dtype]), observation_length)
    return [(e.prompt_ids, e.token_ids, e.policy_mask, e.logprobs, e.turns) for e in episodes]


@pytest.mark.parametrize("observation_length", [1, 6], ids=["1-token", "6-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_sampled_logprob_equals_the_recompute_of_the_whole_transcript(
    dtype, observation_length
):
    model = patched_model("tiny-llama", dtype)
    episodes = _episodes(model, observation_length)
    assert len(episodes) == 8
    multi_turn = [e for e in episodes if e.turns > 1]
    assert multi_turn, "no episode got past its first turn: the test would prove nothing"
    for e in multi_turn:  # observations sit between turns, where the mask says
        assert not all(e.policy_mask) and e.policy_mask[0]
    for e in episodes:
        trainer, engine = _policy_logprobs(model, e)
        assert trainer.dtype == engine.dtype == torch.float32
        assert torch.equal(trainer, engine), (e.prompt_index, e.sample_index)
        observed = ~torch.tensor(e.policy_mask)
        assert bool((e.logprobs[observed] == 0).all())  # an observation has no rollout logprob


THREADS_SNIPPET = """
from tests.envs.test_engine_parity import sampled_episodes

result = sampled_episodes("{name}", "{dtype}", {observation_length})
"""


def _matrix():
    for name in FAMILIES:
        for dtype in DTYPES:
            for threads in (1, 2):
                for observation, length in OBSERVATION_LENGTHS.items():
                    kept = (name, dtype, threads, length) == ("tiny-llama", "fp32", 2, 6)
                    yield pytest.param(
                        name,
                        dtype,
                        threads,
                        length,
                        marks=() if kept else pytest.mark.exhaustive,
                        id=f"{name}-{dtype}-{threads}threads-{observation}",
                    )


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize("name,dtype,threads,observation_length", list(_matrix()))
def test_episodes_sampled_at_one_and_two_threads_equal_the_recompute(
    name, dtype, threads, observation_length
):
    """Episodes sampled by an engine at `threads` intra-op threads (a worker process); the
    trainer's recompute of each whole transcript in this process: equal at every policy token."""
    code = THREADS_SNIPPET.format(name=name, dtype=dtype, observation_length=observation_length)
    episodes = run_with_threads(code, threads)
    assert len(episodes) == 8
    assert any(turns > 1 for *_, turns in episodes), "no episode got past its first turn"
    model = patched_model(name, DTYPES[dtype])
    for prompt_ids, token_ids, policy_mask, logprobs, _ in episodes:
        ids = torch.tensor([prompt_ids + token_ids])
        with torch.no_grad():
            trainer = token_logprobs(model, ids)[0, len(prompt_ids) - 1 :]
        mask = torch.tensor(policy_mask)
        assert torch.equal(trainer[mask], logprobs[mask]), (name, dtype, threads, prompt_ids)


@pytest.mark.exhaustive
def test_a_moe_family_is_exact_too():
    model = patched_model("tiny-qwen3-moe", torch.float32)
    for e in _episodes(model, 3):
        trainer, engine = _policy_logprobs(model, e)
        assert torch.equal(trainer, engine)


def _plain_engine_cases():
    for name in FAMILIES:
        for dtype in DTYPES:
            kept = (name, dtype) == ("tiny-llama", "fp32")
            yield pytest.param(name, dtype, marks=() if kept else pytest.mark.exhaustive)


@pytest.mark.parametrize("name,dtype", list(_plain_engine_cases()))
def test_negative_control_the_plain_engine_differs(name, dtype):
    """The same episodes sampled by an unpatched engine: its logprobs are not the patched
    trainer's recompute on every token."""
    plain = fresh_model(name, DTYPES[dtype], patched=False)
    trainer_model = patched_model(name, DTYPES[dtype])
    pairs = [_policy_logprobs(trainer_model, e) for e in _episodes(plain, 6)]
    trainer = torch.cat([t for t, _ in pairs])
    engine = torch.cat([r for _, r in pairs])
    fraction = (trainer == engine).float().mean().item()
    print(f"\nplain {name} {dtype}, multi-turn: {fraction:.1%} of policy tokens exactly equal")
    assert fraction < 1.0
