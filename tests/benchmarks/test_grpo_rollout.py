"""The GRPO-shaped rollout case (rl_engine/benchmarks/grpo_rollout.py; run whole by
tests/benchmarks/test_rollout.py): its prompts are ragged around the asked length, seeded and
inside the vocabulary; a tokens or logprobs difference between sharing on and off raises; the
table has the columns the smoke test reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_engine.benchmarks.grpo_rollout import check_equal, grpo_prompts, markdown_table
from tests.helpers.bench_tables import tables


def test_prompts_are_seeded_ragged_and_inside_the_vocabulary():
    prompts = grpo_prompts(vocab=50, prompts=32, prompt_tokens=16)
    assert prompts == grpo_prompts(vocab=50, prompts=32, prompt_tokens=16)
    lengths = {len(p) for p in prompts}
    assert lengths <= set(range(14, 19)) and len(lengths) > 1
    assert all(3 <= t < 50 for p in prompts for t in p)


def completion(tokens, logprobs):
    return SimpleNamespace(
        prompt_index=0, sample_index=1, token_ids=tokens, logprobs=torch.tensor(logprobs)
    )


def test_a_difference_between_sharing_on_and_off_raises():
    same = [completion([5, 6], [-0.5, -1.0])]
    check_equal(same, [completion([5, 6], [-0.5, -1.0])])
    with pytest.raises(RuntimeError, match="prompt 0 sample 1: sharing the prefill changed"):
        check_equal(same, [completion([5, 6], [-0.5, -1.5])])
    with pytest.raises(RuntimeError, match="sharing the prefill changed"):
        check_equal(same, [completion([5, 7], [-0.5, -1.0])])


def test_the_table_row():
    row = {"shape": "2 x ~8 tok", "dtype": "float32", "threads": 1, "on": 1.0, "off": 2.0,
           "first_on": 0.5, "first_off": 0.5, "prefill_tokens_on": 8, "prefill_tokens_off": 16,
           "shared": 2}  # fmt: skip
    ((parsed,),) = tables(markdown_table(row))
    assert parsed["off / on"] == "2.00x" and parsed["tokens and logprobs"] == "equal"
    assert (parsed["prefill tokens on"], parsed["shared prefills"]) == ("8", "2")
