"""load_weights: in-place copy, version bump, tied embeddings, and validation before any write."""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.weights import plan_weight_copy
from tests.helpers.rollout.common import (
    assert_parity,
    fresh_model,
    random_prompts,
    recompute_padded,
)

PROMPTS = random_prompts(999, (4, 7, 2), seed=6)
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.8, seed=2)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _perturbed(model, scale=0.05):
    """A state dict of noisy weights; tied names (one tensor) get the same noisy value."""
    g = torch.Generator().manual_seed(1)
    by_tensor, state = {}, {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in by_tensor:
            by_tensor[v.data_ptr()] = v + scale * torch.randn(v.shape, generator=g).to(v.dtype)
        state[k] = by_tensor[v.data_ptr()].clone()
    return state


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"], ids=["tied", "untied"])
def test_load_weights_changes_logprobs_and_version_and_keeps_parity(name):
    model = fresh_model(name)
    params_before = {n: p for n, p in model.named_parameters()}
    engine = RolloutEngine(model, device="cpu", progress=False)
    first = engine.generate(PROMPTS, SAMPLING)
    original = _snapshot(model)

    engine.load_weights(_perturbed(model), version=1)
    assert engine.weight_version == 1
    assert all(
        p is params_before[n] for n, p in model.named_parameters()
    )  # in place: same Parameter objects
    second = engine.generate(PROMPTS, SAMPLING)
    assert all(c.weight_version == 1 for c in second)
    assert not torch.equal(first[0].logprobs, second[0].logprobs)
    assert_parity(second, recompute_padded(model, second, 0.8, "left"), "after load_weights")

    engine.load_weights(original, version=2)
    third = engine.generate(PROMPTS, SAMPLING)
    for a, b in zip(first, third):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_tied_head_key_is_optional_but_must_agree():
    model = fresh_model("tiny-llama")  # tied embeddings
    engine = RolloutEngine(model, device="cpu", progress=False)
    state = _perturbed(model)
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    without_head = {k: v for k, v in state.items() if k != "lm_head.weight"}
    engine.load_weights(without_head, version=1)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    engine.load_weights(state, version=2)  # with the duplicate key: fine when equal
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight.*tied"):
        engine.load_weights(state, version=3)
    assert engine.weight_version == 2


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (
            lambda s: s.update({"model.extra.weight": torch.zeros(2)}),
            r"unexpected key 'model.extra.weight'",
        ),
        (lambda s: s.pop("model.norm.weight"), r"missing key 'model.norm.weight'"),
        (
            lambda s: s.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}),
            r"model.layers.1.mlp.up_proj.weight.*shape \(3, 3\).*\(344, 128\)",
        ),
        (lambda s: s.update({"model.norm.weight": [1.0]}), r"must be a tensor"),
    ],
)
def test_bad_state_dict_raises_before_changing_anything(corrupt, match):
    model = fresh_model("tiny-qwen2")
    engine = RolloutEngine(model, device="cpu", progress=False)
    state = _perturbed(model)
    corrupt(state)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        engine.load_weights(state, version=5)
    assert engine.weight_version == 0
    after = _snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_version_raises():
    engine = RolloutEngine(fresh_model("tiny-llama"), device="cpu", progress=False)
    with pytest.raises(ValueError, match="version"):
        engine.load_weights({}, version="one")


def test_the_copy_plan_names_a_bad_state_dict_before_any_write():
    """plan_weight_copy checks everything first: a wrong key, type, shape or tied pair is named."""
    model = fresh_model("tiny-llama", torch.float32)
    good = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = plan_weight_copy(model, good)
    assert all(target.shape == value.shape for target, value in plan)
    name = next(k for k in good if k.endswith("q_proj.weight"))
    cases = [
        ({**good, "nope": torch.zeros(1)}, "unexpected key 'nope'"),
        ({**good, name: 1.0}, rf"state_dict\['{name}'\] must be a tensor, got float"),
        ({**good, name: torch.zeros(2, 2)}, r"has shape \(2, 2\), the model expects"),
        ({k: v for k, v in good.items() if k != name}, f"missing key '{name}'"),
        ([("a", 1)], "must be a mapping of names to tensors, got list"),
    ]
    for state, message in cases:
        with pytest.raises(ValueError, match=message):
            plan_weight_copy(model, state)
