"""One prefill per prompt: sharing on gives the completions of a prefill per sample, bit for bit.

Chain (torch.equal): engine with `share_prompt_prefill=True` == the same engine with
`False` (every sample prefilled on its own: tokens, logprobs, finish reasons, the schedule),
and the engine without sharing == the trainer's teacher-forced recompute
(tests/rollout/test_parity.py), so the shared engine == the trainer. Scenario: n = 4 samples
of 7 prompts of mixed lengths, two of them repeated across groups, 28 requests through 6
slots (admissions mid-run, some copying a live slot's prompt rows), stop tokens ending
completions early (an EOS id among them: one path, `SamplingParams.stops_on`). Four dense families and one MoE, fp32 and bf16 (tiny-llama fp32
in `make test`, the rest exhaustive); 1 and 2 threads; TP = 2 (each rank copies its own KV
heads) against TP = 1 without sharing (run in tests/rollout/tp/test_launch.py's spawn of 2
ranks). Negative control: an unpatched fp32 model, whose
prefill depends on its batch, gives other bits when it shares.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.completion import Request
from rl_engine.rollout.prompt_sharing import PromptSharing
from tests.helpers.invariance import run_with_threads
from tests.helpers.rollout.common import (
    DENSE_FAMILIES,
    SHARING_SLOTS,
    assert_same_completions,
    fresh_model,
    generate_sharing_scenario,
    patched_model,
    random_prompts,
    sharing_scenario_prompts,
    sharing_scenario_sampling,
)


def _cases():
    for name in (*DENSE_FAMILIES, "tiny-qwen3-moe"):
        for dtype, dtype_id in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            kept = (name, dtype) == ("tiny-llama", torch.float32)
            marks = [] if kept else [pytest.mark.exhaustive]
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype_id}")


@pytest.mark.parametrize(("name", "dtype"), list(_cases()))
def test_shared_prefill_gives_the_per_sample_prefills_bits(name, dtype):
    model = patched_model(name, dtype)
    shared, on = generate_sharing_scenario(model, share=True)
    alone, off = generate_sharing_scenario(model, share=False)
    assert_same_completions(shared, alone, f"{name} {dtype} sharing on vs off")
    assert on.batch_sizes == off.batch_sizes  # the same schedule, step by step
    # the scenario exercises what it should
    assert on.shared_prefills > 0 and off.shared_prefills == 0
    assert on.prefill_forwards < off.prefill_forwards  # some admission copied live slots only
    assert on.prefill_tokens < off.prefill_tokens and on.admitted_while_running > 0
    assert {c.finish_reason for c in shared} == {"stop", "length"}


def test_one_prompt_of_n_samples_prefills_once():
    model = patched_model("tiny-llama")
    prompt = random_prompts(model.config.vocab_size, (9,), seed=1)
    sampling = SamplingParams(n=4, max_new_tokens=3, seed=0)
    stats = {}
    for share in (True, False):
        engine = RolloutEngine(
            model, device="cpu", max_batch_size=4, progress=False, share_prompt_prefill=share
        )
        engine.generate(prompt, sampling)
        stats[share] = engine.last_stats
    assert (stats[True].prefill_forwards, stats[True].shared_prefills) == (1, 3)
    assert stats[True].prefill_tokens == 9 and stats[False].prefill_tokens == 4 * 9
    assert stats[False].shared_prefills == 0


def test_negative_control_an_unpatched_model_changes_its_bits_when_it_shares():
    """Unpatched (plain torch GEMMs and SDPA), a prefill's bits depend on its batch: a forward
    of each distinct prompt (sharing) and a forward of every sample's copy of it (no sharing)
    give other logprobs. (In bf16 this tiny model's plain prefills happen to agree: the fp32
    logits' differences vanish in bf16 hidden states, so the control is fp32.)"""
    model = fresh_model("tiny-llama", torch.float32, patched=False)
    shared, _ = generate_sharing_scenario(model, share=True)
    alone, _ = generate_sharing_scenario(model, share=False)
    same = [torch.equal(a.logprobs, b.logprobs) for a, b in zip(shared, alone, strict=True)]
    assert not all(same), "plain prefill became batch-invariant: re-check the negative control"


# ------------------------------------------------------------------------------ threads

THREADS_SNIPPET = """
import torch
from tests.helpers.rollout.common import generate_sharing_scenario, patched_model

result = {}
for dtype in (torch.float32, torch.bfloat16):
    for share in (True, False):
        completions, _ = generate_sharing_scenario(patched_model("{name}", dtype), share)
        result[str(dtype), share] = [(c.token_ids, c.logprobs) for c in completions]
"""


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize(
    "name", ["tiny-qwen2", pytest.param("tiny-qwen3-moe", marks=pytest.mark.exhaustive)]
)
def test_sharing_on_equals_off_at_one_and_two_threads(name):
    """Sharing on with 1 thread == off with 2 threads, and on with 2 == off with 1."""
    runs = {n: run_with_threads(THREADS_SNIPPET.replace("{name}", name), n) for n in (1, 2)}
    for dtype in ("torch.float32", "torch.bfloat16"):
        for on, off in ((1, 2), (2, 1)):
            a, b = runs[on][dtype, True], runs[off][dtype, False]
            for (tokens_a, lp_a), (tokens_b, lp_b) in zip(a, b, strict=True):
                assert tokens_a == tokens_b and torch.equal(lp_a, lp_b), (name, dtype, on, off)


# ------------------------------------------------------------------------------ TP = 2


# tests/rollout/tp/test_launch.py::test_tp2_shares_with_the_bits_of_tp1_without_sharing: the
# TP = 2 case runs in that module's one spawn of 2 ranks.


# ------------------------------------------------------------------------------ the parts


def _request(prompt, sample, slot, shares=True):
    request = Request(0, sample, list(prompt), key=0, shares_prefill=shares)
    request.slot = slot
    return request


def test_the_plan_runs_one_request_per_prompt_and_copies_live_slots():
    sharing = PromptSharing(enabled=True)
    a0, a1, b0, a2 = (
        _request(prompt, sample, slot)
        for slot, (prompt, sample) in enumerate(
            [([5, 6, 7], 0), ([5, 6, 7], 1), ([5, 6], 0), ([5, 6, 7], 2)]
        )
    )
    plan = sharing.plan([a0, a1, b0, a2])
    assert plan.run == [a0, b0] and plan.copies == [(a1, 0), (a2, 0)]
    logp = torch.tensor([[0.0, -1.0], [-2.0, -3.0]])
    rows = sharing.first_logprobs([a0, a1, b0, a2], plan, logp)
    assert torch.equal(rows, logp[[0, 0, 1, 0]])
    a0.slot, a0.finish_reason = -1, "stop"  # released: a later request copies a1 (slot 1)
    late = _request([5, 6, 7], 3, 0)
    plan = sharing.plan([late])
    assert plan.run == [] and plan.copies == [(late, 1)]
    assert torch.equal(sharing.first_logprobs([late], plan, None), logp[[0]])
    for request in (a1, a2, late, b0):
        request.slot = -1
    fresh = _request([5, 6, 7], 4, 2)
    assert sharing.plan([fresh]).run == [fresh]  # no live slot holds it: prefill again


def test_a_request_that_does_not_share_always_prefills():
    """The multi-turn seam: a prefill after an environment turn never shares."""
    sharing = PromptSharing(enabled=True)
    first, again = _request([4, 4], 0, 0), _request([4, 4], 1, 1, shares=False)
    assert first.share_key == (4, 4) and again.share_key is None
    plan = sharing.plan([first, again])
    assert plan.run == [first, again] and plan.copies == []
    off = PromptSharing(enabled=False)
    assert off.plan([first, _request([4, 4], 2, 2)]).copies == []


def test_prompts_after_an_environment_turn_never_share():
    """generate(..., after_env_turn=True): every request prefills on its own, with the bits
    of the engine that never shares."""
    model = patched_model("tiny-llama")
    vocab = model.config.vocab_size
    prompts, sampling = sharing_scenario_prompts(vocab), sharing_scenario_sampling(vocab)
    engine = RolloutEngine(model, device="cpu", max_batch_size=SHARING_SLOTS, progress=False)
    continued = engine.generate(prompts, sampling, after_env_turn=True)
    assert engine.last_stats.shared_prefills == 0
    alone, off = generate_sharing_scenario(model, share=False)
    assert engine.last_stats.prefill_tokens == off.prefill_tokens
    assert_same_completions(continued, alone, "after_env_turn vs sharing off")
    with pytest.raises(ValueError, match="after_env_turn must be true or false, got 'yes'"):
        engine.generate(prompts, sampling, after_env_turn="yes")


def test_share_prompt_prefill_must_be_a_bool():
    with pytest.raises(ValueError, match="share_prompt_prefill must be true or false, got 1"):
        RolloutEngine(patched_model("tiny-llama"), device="cpu", share_prompt_prefill=1)


def test_the_config_key_defaults_on_and_fails_like_its_neighbours():
    assert RunConfig().rollout.share_prompt_prefill is True
    off = RunConfig.from_dict({"rollout": {"share_prompt_prefill": False}})
    assert off.rollout.share_prompt_prefill is False
    with pytest.raises(ValueError) as err:
        RunConfig.from_dict({"rollout": {"share_prompt_prefill": "yes"}})
    assert str(err.value) == "rollout.share_prompt_prefill must be true or false, got 'yes'"
