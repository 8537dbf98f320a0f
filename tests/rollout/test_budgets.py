"""`generate(..., budgets=...)`: each prompt's own most sampled tokens. A completion cut at its
budget is the first tokens of the uncut one, logprobs included (the draws are position-keyed
and every op row-invariant), and bad budgets are named."""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.rollout.common import patched_model, random_prompts


def test_each_prompt_stops_at_its_own_budget_with_the_uncut_bits():
    model = patched_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    prompts = random_prompts(model.config.vocab_size, (5, 9, 7, 12), seed=4)
    sampling = SamplingParams(max_new_tokens=12, n=2, seed=2)
    whole = engine.generate(prompts, sampling)
    cut = engine.generate(prompts, sampling, budgets=[3, 12, 1, 7])
    for w, c in zip(whole, cut, strict=True):
        budget = [3, 12, 1, 7][c.prompt_index]
        assert len(c.token_ids) == budget and c.finish_reason == "length"
        assert c.token_ids == w.token_ids[:budget]
        assert torch.equal(c.logprobs, w.logprobs[:budget])


@pytest.mark.parametrize(
    "budgets, message",
    [
        ([3], "one per prompt"),
        ([0, 2], r"budgets\[0\]"),
        ([2, 13], r"budgets\[1\]"),
        ([2, 1.0], r"budgets\[1\]"),
    ],
)
def test_bad_budgets_are_named(budgets, message):
    engine = RolloutEngine(patched_model("tiny-llama"), device="cpu", progress=False)
    with pytest.raises(ValueError, match=message):
        engine.generate([[5, 6], [7, 8]], SamplingParams(max_new_tokens=12), budgets=budgets)
