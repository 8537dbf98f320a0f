"""Continuous batching (rollout/scheduler.py): which request runs in which slot, at every step.

What it checks, with the real Stepper on tiny-llama recording its forwards (no stop tokens,
so the schedule follows from the requests' budgets alone): at most `num_slots` requests run;
waiting requests enter the lowest free slots as soon as a request finishes; a finished request frees its slot (slot -1)
and advances the bar once; the stats count every prefill and decode forward, each decode's
batch and the admissions while others run; a continuation that `next_turn` returns keeps its
slot and is prefilled at the next iteration, before any waiting request. The real engine
drives the same function: its stats show the same waves.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams, SlotKVCache
from rl_engine.rollout.completion import Request
from rl_engine.rollout.scheduler import GenerateStats, run_continuous_batching
from rl_engine.rollout.stepper import Stepper
from tests.helpers.rollout.common import patched_model, random_prompts

SAMPLING = SamplingParams(max_new_tokens=8, seed=0)  # no stop tokens: budgets end requests


class RecordingStepper(Stepper):
    """The real Stepper, recording (kind, [(prompt index, slot)]) of every forward it runs."""

    def __init__(self, num_slots: int):
        engine = RolloutEngine(patched_model("tiny-llama"), device="cpu", progress=False)
        super().__init__(engine, SlotKVCache(num_slots, 32, "cpu"), SAMPLING)
        self.calls = []

    def prefill(self, requests):
        self.calls.append(("prefill", [(r.prompt_index, r.slot) for r in requests]))
        return super().prefill(requests)

    def decode(self, requests):
        self.calls.append(("decode", [(r.prompt_index, r.slot) for r in requests]))
        super().decode(requests)


class Bar:
    """Counts what the scheduler reports finished (the engine passes a tqdm bar)."""

    def __init__(self):
        self.count = 0

    def update(self, n):
        self.count += n


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():  # as the engine runs its forwards
        yield


def _requests(budgets):
    return [
        Request(i, 0, [3 + i, 4, 5], key=i, max_new_tokens=budget)
        for i, budget in enumerate(budgets)
    ]


def test_requests_take_the_lowest_free_slot_as_soon_as_one_frees():
    requests, step, stats, bar = (
        _requests([2, 3, 1, 2]),
        RecordingStepper(2),
        GenerateStats(),
        Bar(),
    )
    run_continuous_batching(requests, step, 2, stats, bar)
    assert step.calls == [
        ("prefill", [(0, 0), (1, 1)]),
        ("decode", [(0, 0), (1, 1)]),  # request 0 reaches its budget of 2: slot 0 frees
        ("prefill", [(2, 0)]),  # admitted while request 1 runs; done after one token
        ("decode", [(1, 1)]),
        ("prefill", [(3, 0)]),
        ("decode", [(3, 0)]),
    ]
    assert [len(r.token_ids) for r in requests] == [2, 3, 1, 2]
    assert all(r.finish_reason == "length" and r.slot == -1 for r in requests)
    assert bar.count == 4
    assert (stats.slots, stats.prefill_forwards, stats.decode_forwards) == (2, 3, 3)
    assert (stats.batch_sizes, stats.admitted_while_running, stats.prefill_tokens) == (
        [2, 1, 1],
        1,
        12,
    )


def test_a_continuation_keeps_its_slot_and_runs_before_waiting_requests():
    requests, step, stats, bar = _requests([1, 1]), RecordingStepper(1), GenerateStats(), Bar()
    followers = []

    def next_turn(request):
        if request is not requests[0]:
            return None
        held = request.length - 1  # its last sampled token was never fed: not in the slot
        ids = [*request.prompt_ids, *request.token_ids, 9]
        followers.append(Request(0, 0, ids, key=0, max_new_tokens=1, cached=held))
        return followers[-1]

    run_continuous_batching(requests, step, 1, stats, bar, next_turn)
    assert step.calls == [("prefill", [(0, 0)]), ("prefill", [(0, 0)]), ("prefill", [(1, 0)])]
    (follower,) = followers
    assert len(follower.token_ids) == 1 and follower.slot == -1
    assert (stats.continuations, stats.continued_while_running, stats.decode_forwards) == (1, 0, 0)
    assert stats.prefill_tokens == 3 + 2 + 3  # the continuation prefills its 2 new ids only
    assert bar.count == 2  # the episode counts once, when its last turn ends


def test_the_engine_never_runs_more_sequences_than_its_slots():
    engine = RolloutEngine(
        patched_model("tiny-llama"), device="cpu", max_batch_size=3, progress=False
    )
    sampling = SamplingParams(max_new_tokens=4, seed=3)
    completions = engine.generate(random_prompts(1000, (2, 5, 3, 4, 6, 2, 3), seed=1), sampling)
    stats = engine.last_stats
    assert len(completions) == 7 and stats.slots == 3
    # no stop tokens: each wave of 3, 3 and 1 requests takes one prefill and 3 decodes
    assert stats.prefill_forwards == 3
    assert stats.batch_sizes == [3] * 6 + [1] * 3
