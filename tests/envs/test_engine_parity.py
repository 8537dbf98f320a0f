"""Multi-turn episodes on the real engine are exact: every token the policy sampled has the
logprob the trainer recomputes teacher-forced over the whole transcript, bit for bit.

The chain: each turn is a `generate` call whose prompt is the whole transcript so far
(prompt, earlier turns, observations), so the turn's first token is scored by a prefill of
the transcript and the rest by decode steps, in whatever batch continuous batching made;
prefill is batch-invariant and prefill == decode, therefore engine == the trainer's
`token_logprobs` of prompt + every turn + every observation. Observations of 1 id and of
many, and a scheduler of 3 slots for 8 episodes (episodes of different lengths prefill and
decode beside each other). Negative control: the plain (unpatched) engine differs.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.envs import EpisodeLimits, TurnCodec, run_episodes
from rl_engine.logprobs import token_logprobs
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.envs.scripted import Answer, engine_turns
from tests.rollout.helpers import fresh_model, patched_model, random_prompts

PROMPT_LENGTHS = (5, 11, 3, 8)


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


@pytest.mark.exhaustive
def test_a_moe_family_is_exact_too():
    model = patched_model("tiny-qwen3-moe", torch.float32)
    for e in _episodes(model, 3):
        trainer, engine = _policy_logprobs(model, e)
        assert torch.equal(trainer, engine)


def test_negative_control_the_plain_engine_differs():
    """The same episodes sampled by an unpatched engine: its logprobs are not the patched
    trainer's recompute on every token."""
    plain = fresh_model("tiny-llama", torch.float32, patched=False)
    trainer_model = patched_model("tiny-llama", torch.float32)
    pairs = [_policy_logprobs(trainer_model, e) for e in _episodes(plain, 6)]
    trainer = torch.cat([t for t, _ in pairs])
    engine = torch.cat([r for _, r in pairs])
    fraction = (trainer == engine).float().mean().item()
    print(f"\nplain engine, multi-turn: {fraction:.1%} of policy tokens exactly equal")
    assert fraction < 1.0
