"""Bitwise parity: the engine's recorded logprobs == token_logprobs' teacher-forced recompute.

The recompute runs the sequence alone, in left- and right-padded batches with
other sequences (attention_mask), and at a random row of batches of other
sizes; 8 model families (4 dense, 4 mixture-of-experts) x fp32/bf16 x
temperature 1.0/0.7, with 7 requests through 3 slots so that continuous
batching swaps sequences in and out. The MoE families at temperature 0.7 are
slow-marked (the suite runs each of them at 1.0 in both dtypes).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.patching import RoutingRecorder, apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.rollout.common import (
    DENSE_FAMILIES,
    DTYPES,
    MOE_FAMILIES,
    assert_parity,
    fresh_model,
    patched_model,
    random_prompts,
    recompute_alone,
    recompute_in_batches_of,
    recompute_padded,
    stop_ids,
)

PROMPT_LENGTHS = (5, 11, 1, 17, 3, 8, 26)  # 7 requests, ragged
MAX_NEW = 24


def _generate(model, temperature, seed=0):
    vocab = model.config.vocab_size
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    sampling = SamplingParams(
        max_new_tokens=MAX_NEW,
        temperature=temperature,
        seed=seed,
        stop_token_ids=stop_ids(vocab, vocab // 20),
    )
    completions = engine.generate(random_prompts(vocab, PROMPT_LENGTHS, seed=seed), sampling)
    return engine, completions


def _cases():
    for name in DENSE_FAMILIES + MOE_FAMILIES:
        for dtype, dtype_id in zip(DTYPES, ("fp32", "bf16")):
            for temperature in (1.0, 0.7):
                slow = name in MOE_FAMILIES and temperature != 1.0
                marks = [pytest.mark.slow, pytest.mark.exhaustive] if slow else []
                yield pytest.param(
                    name, dtype, temperature, marks=marks, id=f"{name}-{dtype_id}-{temperature}"
                )


@pytest.mark.parametrize(("name", "dtype", "temperature"), list(_cases()))
def test_engine_logprobs_equal_teacher_forced_recompute(name, dtype, temperature):
    model = patched_model(name, dtype)
    vocab = model.config.vocab_size
    engine, completions = _generate(model, temperature)

    # continuous batching really happened: sequences of different lengths, swapped into freed slots
    stats = engine.last_stats
    assert stats.admitted_while_running >= 1 and len(set(stats.batch_sizes)) > 1
    assert len({len(c.token_ids) for c in completions}) > 1
    assert all(
        c.logprobs.dtype == torch.float32 and c.logprobs.shape == (len(c.token_ids),)
        for c in completions
    )

    assert_parity(
        completions, [recompute_alone(model, c, temperature) for c in completions], "alone"
    )
    fillers = random_prompts(vocab, (40, 2), seed=9)
    for side in ("left", "right"):
        assert_parity(
            completions, recompute_padded(model, completions, temperature, side, fillers), side
        )
    for size in (2, 5):
        refs = [
            recompute_in_batches_of(model, c, temperature, size, vocab, seed=i)
            for i, c in enumerate(completions)
        ]
        assert_parity(completions, refs, f"batch of {size}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_greedy_logprobs_are_recorded_at_temperature_one(dtype):
    model = patched_model("tiny-qwen3", dtype)
    engine = RolloutEngine(model, device="cpu", max_batch_size=2, progress=False)
    prompts = random_prompts(model.config.vocab_size, (4, 9, 2), seed=3)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert_parity(completions, [recompute_alone(model, c, 1.0) for c in completions], "greedy")
    assert_parity(
        completions, recompute_padded(model, completions, 1.0, "left"), "greedy, left padded"
    )


def test_stop_and_length_both_occur_in_the_parity_run():
    # guards the parity test above: its stop-token setting must really end some sequences early
    model = patched_model("tiny-llama", torch.float32)
    _, completions = _generate(model, 1.0)
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}
    stops = set(stop_ids(model.config.vocab_size, model.config.vocab_size // 20))
    for c in completions:  # a stop token drawn last (at MAX_NEW) still finishes as "stop"
        ends_on_stop = c.token_ids[-1] in stops
        assert not stops & set(c.token_ids[:-1])
        assert c.finish_reason == ("stop" if ends_on_stop else "length")
        assert ends_on_stop or len(c.token_ids) == MAX_NEW


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_engine_parity_when_every_token_meets_an_exact_router_tie(dtype):
    """Experts 1 and 5 of every router share one weight row (which wins often): every token's
    logits tie exactly, decode and recompute must break every tie the same way (lowest index)."""
    from tests.helpers.moe_routers import twin_experts

    model = twin_experts(fresh_model("tiny-qwen3-moe", dtype, patched=False))
    apply_batch_invariant(model)
    _, completions = _generate(model, 1.0)
    with RoutingRecorder(model) as routing:
        alone = [recompute_alone(model, c, 1.0) for c in completions]
    assert_parity(completions, alone, "alone")
    assert_parity(completions, recompute_padded(model, completions, 1.0, "left"), "left")
    chosen = torch.cat([c.indices for calls in routing.calls.values() for c in calls])
    assert bool((chosen == 1).any()), "no token chose the twins: the tie never mattered"
    assert not bool(((chosen == 5).any(-1) & ~(chosen == 1).any(-1)).any())
