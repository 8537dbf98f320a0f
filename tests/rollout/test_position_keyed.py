"""Position-keyed sampling: the token at index i of a request is a function of its logprob row
and (request key, i) alone, whatever was drawn before it, by it or by any other request.

Negative controls: a call-order stream (the per-request torch.Generator the engine used before)
gives other tokens when a draw is skipped or discarded, and the engine with one call-order
stream gives other completions when the batch size changes its draw order.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import rl_engine.rollout.stepper as stepper_module
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.sampling import request_key, sample_token, token_uniform
from tests.helpers.rollout.common import patched_model, random_prompts

VOCAB = 1000  # tiny-llama
ROWS_VOCAB, POSITIONS, REQUESTS = 50, 12, 4
PARAMS = SamplingParams(temperature=1.0, top_k=40, top_p=0.95)


def test_token_uniform_is_a_pure_function_of_key_and_index():
    key = request_key(3, 1, 2)
    values = [token_uniform(key, i) for i in range(64)]
    assert values == [token_uniform(key, i) for i in range(64)]
    assert len(set(values)) == 64 and all(0.0 <= u < 1.0 for u in values)
    assert token_uniform(request_key(3, 1, 3), 0) != values[0]
    # the documented formula, the one another engine (vLLM's sampler) reproduces
    digest = hashlib.blake2b(f"{key}/5".encode(), digest_size=8).digest()
    assert values[5] == (int.from_bytes(digest, "little") >> 11) / 2**53


@pytest.mark.parametrize(
    "key, index, bad",
    [(-1, 0, "key"), (2**63, 0, "key"), (1.0, 0, "key"), (1, -1, "index"), (1, True, "index")],
)
def test_token_uniform_refuses_a_bad_key_or_index(key, index, bad):
    with pytest.raises(ValueError, match=bad):
        token_uniform(key, index)


def _rows() -> list[list[torch.Tensor]]:
    """rows[r][i]: the logprob row of request r at index i (fixed, as a model would give)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(REQUESTS, POSITIONS, ROWS_VOCAB, generator=g)
    return [list(torch.log_softmax(logits[r], -1)) for r in range(REQUESTS)]


def _keyed(rows, r: int, positions) -> list[int]:
    key = request_key(0, r, 0)
    return [sample_token(rows[r][i], PARAMS, token_uniform(key, i)) for i in positions]


def _call_order(rows, r: int, positions, discarded: int = 0) -> list[int]:
    """The old stream: one generator per request, one uniform per call, in call order."""
    g = torch.Generator().manual_seed(request_key(0, r, 0))
    torch.rand(discarded, generator=g, dtype=torch.float64)  # draws made and thrown away
    return [
        sample_token(rows[r][i], PARAMS, torch.rand((), generator=g, dtype=torch.float64).item())
        for i in positions
    ]


def test_a_position_draws_the_same_token_whatever_was_drawn_before():
    rows, everything = _rows(), range(POSITIONS)
    reference = [_keyed(rows, r, everything) for r in range(REQUESTS)]
    # a batch: index i of every request, requests in reverse order (others drawn first)
    batched = [[0] * POSITIONS for _ in range(REQUESTS)]
    for i in everything:
        for r in reversed(range(REQUESTS)):
            batched[r][i] = _keyed(rows, r, [i])[0]
    assert batched == reference
    for r in range(REQUESTS):
        # resumed at index 5 (draws 0..4 never happened here), and index 5 re-drawn twice
        # (a speculative block verified, rejected and decoded again)
        assert _keyed(rows, r, range(5, POSITIONS)) == reference[r][5:]
        assert _keyed(rows, r, [5, 5]) == [reference[r][5]] * 2


def test_negative_control_a_call_order_stream_changes_with_the_draws_before():
    rows, everything = _rows(), range(POSITIONS)
    for r in range(REQUESTS):
        reference = _call_order(rows, r, everything)
        assert _call_order(rows, r, everything) == reference  # reproducible in one order only
        assert _call_order(rows, r, range(5, POSITIONS)) != reference[5:]  # resumed
        assert _call_order(rows, r, everything, discarded=1) != reference  # one draw thrown away


def _generate(max_batch_size: int):
    engine = RolloutEngine(
        patched_model("tiny-llama", torch.float32),
        device="cpu",
        max_batch_size=max_batch_size,
        progress=False,
    )
    prompts = random_prompts(VOCAB, (7, 3, 12, 5), seed=1)
    return engine.generate(prompts, SamplingParams(max_new_tokens=10, n=2, seed=11))


def _tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_completions_are_the_same_one_request_at_a_time_or_eight_at_once():
    # batch 1 draws request 0's tokens before any of request 1's; batch 8 interleaves them
    one, eight = _generate(1), _generate(8)
    assert _tokens(one) == _tokens(eight)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(one, eight))


def test_negative_control_one_call_order_stream_changes_with_the_batch(monkeypatch):
    def shared_stream():
        g = torch.Generator().manual_seed(0)
        return lambda request: torch.rand((), generator=g, dtype=torch.float64).item()

    monkeypatch.setattr(stepper_module, "_next_uniform", shared_stream())
    one = _generate(1)
    monkeypatch.setattr(stepper_module, "_next_uniform", shared_stream())
    assert _tokens(one) != _tokens(_generate(8))
