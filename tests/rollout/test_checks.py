"""The rollout engine's argument checks (rollout/checks.py), called directly.

What it checks: each check returns its argument normalised (prompts as lists of ints, a None
sampling as the default, max_seq_len from the model's config) and refuses a bad one with a
ValueError that names the argument, the prompt's index and the bad value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rl_engine.rollout import SamplingParams
from rl_engine.rollout.checks import (
    check_max_batch_size,
    check_model,
    check_prompts,
    check_sampling,
    check_version,
    resolve_max_seq_len,
)
from tests.helpers.rollout.common import patched_model

SIZES = {"vocab_size": 10, "max_seq_len": 8, "max_new_tokens": 3}


def test_prompts_become_lists_of_ints_whatever_their_form():
    prompts = [[3, 4], (5,), torch.tensor([6, 7, 8], dtype=torch.int32)]
    assert check_prompts(prompts, **SIZES) == [[3, 4], [5], [6, 7, 8]]
    assert check_prompts([], **SIZES) == []


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (5, r"prompts must be a list of token-id lists or 1-D tensors, got int"),
        (torch.ones(2, 2, dtype=torch.long), r"prompts must be a list .* got Tensor"),
        ("ab", r"prompt 0 must be a list of token ids or a 1-D tensor, got str"),
        ([[1], []], r"prompt 1 is empty"),
        ([[1, 10]], r"prompt 0 has token id 10 outside the vocabulary \[0, 10\)"),
        ([[1, True]], r"prompt 0 has a non-integer token id True"),
        ([b"ab"], r"prompt 0 must be a list of token ids or a 1-D tensor, got bytes"),
        (
            [torch.ones(2)],
            r"prompt 0 must be a 1-D integer tensor, got shape \(2,\) dtype torch.float32",
        ),
        ([[1] * 6], r"prompt 0: 6 prompt tokens \+ max_new_tokens 3 = 9 > max_seq_len 8"),
    ],
)
def test_a_bad_prompt_is_named_with_its_index_and_value(prompts, match):
    with pytest.raises(ValueError, match=match):
        check_prompts(prompts, **SIZES)


def test_sizes_and_versions_are_ints_in_range():
    assert check_max_batch_size(4) == 4 and check_version(0) == 0
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"max_batch_size must be an int >= 1, got {bad!r}"):
            check_max_batch_size(bad)
    with pytest.raises(ValueError, match="version must be an int, got '1'"):
        check_version("1")


def test_max_seq_len_defaults_to_the_models_and_must_be_at_least_two():
    model = patched_model("tiny-llama")
    assert resolve_max_seq_len(model, None) == model.config.max_position_embeddings
    assert resolve_max_seq_len(model, 2) == 2
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 2, got 1"):
        resolve_max_seq_len(model, 1)
    configless = nn.Linear(2, 2)
    configless.config = object()
    with pytest.raises(ValueError, match="no max_position_embeddings; pass it"):
        resolve_max_seq_len(configless, None)


def test_sampling_defaults_and_must_be_sampling_params():
    assert check_sampling(None) == SamplingParams()
    with pytest.raises(ValueError, match="sampling must be a SamplingParams, got dict"):
        check_sampling({"temperature": 1.0})


def test_the_model_must_be_a_causal_lm_with_parameters_on_the_engines_device():
    model = patched_model("tiny-llama")
    check_model(model, torch.device("cpu"))
    with pytest.raises(ValueError, match="model must be a Hugging Face causal LM, got Linear"):
        check_model(nn.Linear(2, 2), torch.device("cpu"))
    empty = nn.Module()
    empty.config = model.config
    with pytest.raises(ValueError, match="model has no parameters"):
        check_model(empty, torch.device("cpu"))
    with pytest.raises(ValueError, match="model is on cpu, but the engine's device is meta"):
        check_model(model, torch.device("meta"))
