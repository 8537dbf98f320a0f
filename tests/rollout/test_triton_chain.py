"""The whole logprob chain on the Triton backend: rollout logprobs == teacher-forced recompute, bitwise.

A tiny model patched with backend="triton" (Triton's CPU interpreter here, the
compiled kernels on a GPU). Chain checked, torch.equal per token: the engine's
recorded logprob (prefill + decode steps against its KV cache, continuous
batching swapping sequences in and out of slots) == token_logprobs of the
sequence alone == token_logprobs of all completions in one left-padded batch
with fillers. Negative controls: scoring the same hidden states with the other
backend's linear_logp, and the unpatched model, do not match the engine.
"""

from __future__ import annotations

import functools

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.logprobs import final_hidden_states, scored_targets
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant, lm_head_parameters, patch_handle
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.invariance import skip_if_refused
from tests.helpers.rollout.common import (
    assert_parity,
    completion_slice,
    full_ids,
    random_prompts,
    recompute_alone,
    recompute_padded,
    stop_ids,
)
from tests.helpers.triton_marks import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
CASES = [
    ("tiny-llama", torch.float32),
    pytest.param("tiny-qwen3", torch.bfloat16, marks=pytest.mark.exhaustive),
]
PROMPT_LENGTHS = (5, 9, 2)  # 3 requests through 2 slots: one reuses a freed slot


@functools.cache
def _triton_model(name, dtype):
    model, _ = load_model(name, dtype=dtype, seed=0)
    model.to(DEVICE)  # move first, then patch: ops are resolved for the parameters' device
    apply_batch_invariant(model, backend="triton")
    return model


@functools.cache
def _rollout(name, dtype):
    model = _triton_model(name, dtype)
    engine = RolloutEngine(model, device=DEVICE, max_batch_size=2, progress=False)
    vocab = model.config.vocab_size
    # a seed whose draws leave >= 10 tokens in both cases (the test's floor below)
    sampling = SamplingParams(
        max_new_tokens=4, temperature=0.7, seed=2, stop_token_ids=stop_ids(vocab, vocab // 8)
    )
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=1)
    completions = engine.generate(prompts, sampling)
    return engine, completions, sampling.logprob_temperature


@pytest.mark.parametrize("name,dtype", CASES)
def test_engine_logprobs_equal_teacher_forced_recompute(name, dtype):
    engine, completions, temperature = _rollout(name, dtype)
    model = engine.model
    handle = patch_handle(model)
    assert handle.backend == "triton" and handle.attention_name == "rl_engine_invariant_triton"
    assert all(
        m.op.__module__.startswith("rl_engine.kernels.triton")
        for m in model.modules()
        if hasattr(m, "op")
    )
    assert engine.last_stats.prefill_forwards >= 2  # a freed slot was reused
    assert sum(len(c.token_ids) for c in completions) >= 10
    alone = [recompute_alone(model, c, temperature) for c in completions]
    assert_parity(completions, alone, f"{name} {dtype}: alone")
    fillers = random_prompts(model.config.vocab_size, (4, 13), seed=7)
    padded = recompute_padded(model, completions, temperature, "left", fillers=fillers)
    assert_parity(completions, padded, f"{name} {dtype}: left-padded batch")


@pytest.mark.parametrize("name,dtype", CASES[:1])
def test_negative_control_other_backend_or_unpatched_model_differs(name, dtype):
    skip_if_refused("native", dtype, DEVICE)
    engine, completions, temperature = _rollout(name, dtype)
    model = engine.model
    native_logp = get_op("linear_logp", DEVICE, backend="native")
    weight, bias = lm_head_parameters(model)
    same = 0
    for c in completions:
        ids = torch.tensor([full_ids(c)], device=DEVICE)
        with torch.no_grad():
            hidden = final_hidden_states(model, ids)
            lp = native_logp(
                hidden[:, :-1], weight, scored_targets(ids, None), bias, temperature=temperature
            )[0]
        same += torch.equal(completion_slice(lp, 0, len(c.prompt_ids), ids.shape[1]), c.logprobs)
    assert same < len(completions), "native scoring matched the triton engine: control is void"

    plain, _ = load_model(name, dtype=dtype, seed=0)
    plain.to(DEVICE)
    unpatched = [recompute_alone(plain, c, temperature) for c in completions]
    assert not all(torch.equal(c.logprobs, u) for c, u in zip(completions, unpatched))
