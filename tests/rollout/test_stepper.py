"""The forwards of one generate call (rollout/stepper.py) on a real patched tiny model.

What it checks: the packing rule (a patched prefill packs when padding would compute more than
PACK_PREFILL times its real tokens; an unpatched one never packs); a prefill reports what it
ran (forwards, packed, copies of a shared prompt, prompt tokens: a continuation counts only the
ids its slot does not hold) and gives every admitted request its first token; a decode adds one
token per request; the cache is unbound after every forward, also one that raises. Packed ==
padded prefill, bit for bit: the first token and logprob of every request are torch.equal
whichever way the prefill ran (negative control: another prompt gives other logprobs).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams, SlotKVCache, stepper
from rl_engine.rollout.completion import Request
from rl_engine.rollout.stepper import Stepper, packs_prefill
from tests.helpers.rollout.common import patched_model

SAMPLING = SamplingParams(max_new_tokens=4, seed=5)


@pytest.fixture(autouse=True)
def _inference_mode():
    """The engine runs its forwards under inference mode (its packed GEMMs refuse autograd)."""
    with torch.inference_mode():
        yield


def _stepper(share: bool = True) -> Stepper:
    engine = RolloutEngine(
        patched_model("tiny-llama"), device="cpu", progress=False, share_prompt_prefill=share
    )
    return Stepper(engine, SlotKVCache(4, 16, "cpu"), SAMPLING)


def _requests(prompts, **kwargs) -> list[Request]:
    return [Request(i, 0, p, key=i, slot=i, **kwargs) for i, p in enumerate(prompts)]


def test_a_patched_prefill_packs_only_when_padding_would_cost_too_much():
    assert not packs_prefill(False, [1, 9])  # unpatched: never
    assert not packs_prefill(True, [4, 4])  # no padding at all
    assert packs_prefill(True, [1, 9])  # 2 x 9 = 18 > 1.25 x 10
    assert not packs_prefill(True, [8, 9])  # 18 <= 1.25 x 17


def test_a_prefill_reports_what_it_ran_and_samples_every_first_token():
    step = _stepper()
    requests = _requests([[5, 6, 7], [5, 6, 7], [8, 9, 10]])
    outcome = step.prefill(requests)
    assert (outcome.forwards, outcome.packed, outcome.shared, outcome.tokens) == (1, False, 1, 6)
    assert [len(r.token_ids) for r in requests] == [1, 1, 1]
    step.decode(requests)
    assert [len(r.token_ids) for r in requests] == [2, 2, 2]
    with pytest.raises(RuntimeError, match="outside a bound forward"):
        step.cache.bound()


def test_a_continuation_prefills_only_the_ids_its_slot_does_not_hold():
    step = _stepper()
    (first,) = _requests([[5, 6, 7]])
    step.prefill([first])
    step.decode([first])
    following = Request(0, 0, first.prompt_ids + first.token_ids + [9], key=0, slot=0)
    following.cached = first.length - 1  # the last sampled token was fed, not yet written
    outcome = step.prefill([following])
    assert (outcome.tokens, outcome.packed, len(following.token_ids)) == (2, False, 1)


def _first_tokens(prompts, monkeypatch, pack_prefill):
    monkeypatch.setattr(stepper, "PACK_PREFILL", pack_prefill)
    requests = _requests(prompts)
    outcome = _stepper(share=False).prefill(requests)
    return outcome.packed, [(r.token_ids, r.logprobs) for r in requests]


def test_packed_and_padded_prefills_give_every_request_the_same_bits(monkeypatch):
    prompts = [[5], [6, 7, 8, 9, 10, 11, 12, 13]]
    packed, packed_tokens = _first_tokens(prompts, monkeypatch, 1.25)
    padded, padded_tokens = _first_tokens(prompts, monkeypatch, 100.0)
    assert packed and not padded
    assert packed_tokens == padded_tokens  # python floats of fp32 values: equal means bitwise
    _, other = _first_tokens([[5], [6, 7, 8, 9, 10, 11, 12, 14]], monkeypatch, 1.25)
    assert other[0] == packed_tokens[0] and other[1][1] != packed_tokens[1][1]


def test_a_forward_that_raises_leaves_the_cache_unbound():
    step = _stepper()
    (request,) = _requests([[5, 6]])
    request.slot = 9  # no such slot in a 4-slot cache
    with pytest.raises(IndexError):
        step.prefill([request])
    with pytest.raises(RuntimeError, match="outside a bound forward"):
        step.cache.bound()
