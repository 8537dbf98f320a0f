"""Sampling: reproducibility per request, top-k / top-p, n samples, stop tokens, parameter validation."""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.sampling import candidates, draw, request_key, token_uniform, turn_key
from tests.helpers.rollout.common import assert_same_completions, patched_model, random_prompts

VOCAB = 1000  # tiny-llama


def _engine(max_batch_size=4, dtype=torch.float32, name="tiny-llama"):
    return RolloutEngine(
        patched_model(name, dtype), device="cpu", max_batch_size=max_batch_size, progress=False
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_seed_same_completion_whatever_the_batch(dtype):
    prompts = random_prompts(VOCAB, (7, 3, 12, 5, 9), seed=1)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.9, n=2, seed=11)
    reference = _engine(1, dtype).generate(prompts, sampling)
    for size in (2, 3, 16):
        assert_same_completions(
            reference, _engine(size, dtype).generate(prompts, sampling), f"max_batch_size={size}"
        )

    # other prompts around the same ones (same indices): the shared prompts' completions do not change
    others = random_prompts(VOCAB, (30, 2, 14), seed=2)
    mixed = [prompts[0], others[0], prompts[2], others[1], prompts[4], others[2]]
    result = _engine(3, dtype).generate(mixed, sampling)
    for index in (0, 2, 4):
        assert_same_completions(
            [c for c in reference if c.prompt_index == index],
            [c for c in result if c.prompt_index == index],
            f"prompt {index} among other prompts",
        )


def test_different_seed_different_completion():
    prompts = random_prompts(VOCAB, (6,), seed=1)
    a = _engine().generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
    b = _engine().generate(prompts, SamplingParams(max_new_tokens=8, seed=2))
    assert a[0].token_ids != b[0].token_ids


def test_top_k_one_equals_greedy():
    prompts = random_prompts(VOCAB, (5, 9, 2), seed=3)
    greedy = _engine().generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    top1 = _engine().generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, seed=7)
    )
    assert_same_completions(greedy, top1, "top_k=1 vs greedy")  # T = 1 both: same logprobs too


def test_tiny_top_p_equals_greedy_tokens():
    prompts = random_prompts(VOCAB, (5, 9), seed=3)
    greedy = _engine().generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    nucleus = _engine().generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0.5, top_p=1e-6)
    )
    assert [c.token_ids for c in greedy] == [c.token_ids for c in nucleus]


def test_greedy_samples_are_identical_and_random_samples_differ():
    prompts = random_prompts(VOCAB, (4, 8), seed=5)
    greedy = _engine().generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, n=3))
    for p in range(2):
        assert len({tuple(c.token_ids) for c in greedy if c.prompt_index == p}) == 1
    sampled = _engine().generate(prompts, SamplingParams(max_new_tokens=8, n=4, seed=3))
    assert [(c.prompt_index, c.sample_index) for c in sampled] == [
        (p, s) for p in range(2) for s in range(4)
    ]
    for p in range(2):
        assert len({tuple(c.token_ids) for c in sampled if c.prompt_index == p}) == 4


@pytest.mark.parametrize("field", ["stop_token_ids", "eos_token_id"])
def test_stop_token_ends_the_sequence(field):
    prompts = random_prompts(VOCAB, (6, 3), seed=8)
    free = _engine().generate(prompts, SamplingParams(max_new_tokens=12, seed=4))
    stop = free[0].token_ids[4]  # the 5th token of prompt 0
    value = (stop,) if field == "stop_token_ids" else stop
    stopped = _engine().generate(
        prompts, SamplingParams(max_new_tokens=12, seed=4, **{field: value})
    )
    c = stopped[0]
    first = free[0].token_ids.index(stop)
    assert c.finish_reason == "stop" and c.token_ids == free[0].token_ids[: first + 1]
    assert torch.equal(
        c.logprobs, free[0].logprobs[: first + 1]
    )  # the stop token keeps its logprob
    for before, after in zip(free, stopped):
        if stop not in before.token_ids:
            assert after.finish_reason == "length" and after.token_ids == before.token_ids


def test_top_k_and_top_p_restrict_the_candidates():
    logp = torch.log_softmax(torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0]), -1)
    values, ids = candidates(logp, top_k=2, top_p=1.0)
    assert ids.tolist() == [1, 3] and torch.equal(values, logp[[1, 3]])
    _, ids = candidates(logp, top_k=0, top_p=0.7)  # p = .64, .24, ...: the crossing token is kept
    assert ids.tolist() == [1, 3]
    values, ids = candidates(logp, top_k=0, top_p=1.0)
    assert ids is None and values is logp


def test_draw_follows_the_distribution_and_never_picks_impossible_tokens():
    logp = torch.log(torch.tensor([0.5, 0.0, 0.25, 0.25]))
    key = request_key(0, 0, 0)
    counts = torch.bincount(
        torch.tensor([draw(logp, token_uniform(key, i)) for i in range(4000)]), minlength=4
    )
    assert counts[1] == 0
    assert abs(counts[0].item() / 4000 - 0.5) < 0.05 and abs(counts[2].item() / 4000 - 0.25) < 0.05


@pytest.mark.parametrize("vocab", [999, 32000, 49152, 151936])
def test_draw_is_the_plain_inverse_cdf_bit_for_bit(vocab):
    """The in-place draw picks what the plain formula picks, from the same cdf bits:
    searchsorted(cumsum(exp(logp - max)) in fp64, u * total), for vocabularies of every
    remainder and rows with -inf (masked) entries."""
    g = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        logp = torch.log_softmax(torch.randn(vocab, generator=g) * (1 + trial), -1)
        if trial % 3 == 0:
            logp[torch.randint(0, vocab, (vocab // 7,), generator=g)] = float("-inf")
        u = float(torch.rand((), generator=g, dtype=torch.float64))
        cdf = (logp.double() - logp.max().double()).exp().cumsum(0)
        target = torch.tensor(u, dtype=torch.float64) * cdf[-1]
        expected = min(int(torch.searchsorted(cdf, target, right=True)), vocab - 1)
        assert draw(logp, u) == expected
        # the in-place scan gives the formula's cdf, element for element
        weights = logp.double()
        weights.sub_(weights.max()).exp_()
        assert torch.equal(torch.cumsum(weights, 0, out=weights), cdf)


def test_request_and_turn_keys_are_distinct_and_reproducible():
    def keys():
        requests = [request_key(0, p, s) for p in range(3) for s in range(3)]
        return requests + [turn_key(0, e, t) for e in range(3) for t in range(1, 4)]

    first = keys()
    assert first == keys()
    assert len(set(first)) == 18 and all(0 <= k < 2**63 for k in first)
    assert request_key(1, 0, 0) != request_key(0, 0, 0) != turn_key(0, 0, 0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n"),
        ({"seed": "1"}, "seed"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"n": True}, "n"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_are_frozen_and_normalise_stop_ids():
    params = SamplingParams(stop_token_ids=[5, 6])
    assert params.stop_token_ids == (5, 6) and hash(params)
    with pytest.raises(AttributeError):
        params.n = 3
