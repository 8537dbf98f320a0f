"""The asynchronous schedule (executors/job/async_schedule.py) on its own: which steps are
generated beside which, what a step takes, what a too-old batch costs, and pending rollouts
through a checkpoint folder.

`AsyncPipeline` is given its two callables as the job gives them (generate a step's rollouts
with the engines' weights; verify them on the ranks); here they record what they were asked.
The job tests (test_async_job.py) run the real ones.
"""

from __future__ import annotations

import threading
import time

import torch

from rl_engine.config import RunConfig
from rl_engine.executors.job.async_schedule import AsyncPipeline, ReadyRollouts
from tests.helpers.worker.completions import completion


class Engines:
    """Generates step s's rollouts with the version it serves; records every call."""

    def __init__(self):
        self.version, self.calls, self.seconds = 0, [], 0.0

    def __call__(self, step: int, clock=None) -> ReadyRollouts:
        self.calls.append(step)
        time.sleep(self.seconds)
        logprobs = torch.tensor([-0.1 * step - 1 / 3, -2.0], dtype=torch.float32)
        comps = [
            completion([4, 5], [6 + step, 7], logprobs=logprobs, index=i, version=self.version)
            for i in range(2)
            for _ in range(2)
        ]
        for j, c in enumerate(comps):
            c.sample_index = j % 2
        return ReadyRollouts(step, comps, [1.0, 0.0, 0.5, 0.25], {"reward/mean": 0.4})


def _pipeline(k: int, order: str = "deterministic", steps: int = 6):
    config = RunConfig.from_dict(
        {"steps": steps, "rollout": {"max_staleness": k, "async_order": order}}
    )
    engines = Engines()
    verify = lambda ready: {"parity/exact_match_fraction": 1.0, "checked": ready.step}  # noqa: E731
    return AsyncPipeline(config, engines, verify), engines


def _run_steps(pipeline, engines, steps: int) -> list[tuple[int, int]]:
    """(step, the version of its rollouts) for every step, each version one update after the last."""
    seen = []
    for step in range(steps):
        ready, figures = pipeline.take(step, engines.version)
        assert figures["async/staleness_max"] == engines.version - ready.version
        pipeline.beside(step, lambda: None)
        engines.version += 1  # the update, then the sync
        seen.append((step, ready.version))
    pipeline.close()
    return seen


def test_deterministic_step_s_is_generated_by_the_version_of_step_s_minus_k():
    for k in (1, 2, 3):
        pipeline, engines = _pipeline(k)
        assert _run_steps(pipeline, engines, 6) == [(s, max(0, s - k)) for s in range(6)]
        assert engines.calls == list(range(6))  # each step's rollouts generated once, in order


def test_generated_rollouts_are_verified_and_wait_with_their_figures():
    pipeline, engines = _pipeline(2)
    pipeline.take(0, 0)
    _, figures = pipeline.beside(0, lambda: "trained")
    assert figures["async/generated"] == 2 and 0.0 <= figures["async/overlap"] <= 1.0
    assert sorted(pipeline.pending) == [1, 2]
    assert pipeline.pending[2].parity == {"parity/exact_match_fraction": 1.0, "checked": 2}
    assert pipeline.ahead(1) == [3] and pipeline.ahead(4) == [5] and pipeline.ahead(5) == []
    pipeline.close()


def test_rollouts_older_than_k_versions_are_dropped_counted_and_generated_again(tmp_path):
    """A run checkpointed with k = 2 and resumed with k = 1: step 2's rollouts (version 0) are
    2 published versions old at step 2, one too many."""
    pipeline, engines = _pipeline(2)
    for step in (0, 1):
        pipeline.take(step, engines.version)
        pipeline.beside(step, lambda: None)
        engines.version += 1
    state = pipeline.save(tmp_path)
    pipeline.close()
    resumed, engines = _pipeline(1)
    resumed.restore(tmp_path, state)
    engines.version = 2
    ready, figures = resumed.take(2, engines.version)
    assert figures["async/dropped"] == 4.0 and ready.version == 2
    assert figures["async/staleness_max"] == 0.0 and engines.calls == [2]
    ready, figures = resumed.take(3, engines.version)  # version 1: one version old, kept
    assert figures["async/dropped"] == 0.0 and figures["async/staleness_max"] == 1.0
    resumed.close()


def test_a_step_of_several_updates_publishes_one_version():
    """Mini-batches or epochs: the ranks' version moves by several updates a step, the engines
    see one sync: a step-old batch is one version old."""
    pipeline, engines = _pipeline(1)
    pipeline.take(0, 0)
    pipeline.beside(0, lambda: None)
    ready, figures = pipeline.take(1, 4)  # four updates in step 0
    assert ready.version == 0 and figures["async/staleness_max"] == 1.0
    assert figures["async/dropped"] == 0.0
    pipeline.close()


def test_free_order_stops_once_the_ranks_are_done_and_the_next_step_exists():
    pipeline, engines = _pipeline(3, order="free")
    pipeline.take(0, 0)
    engines.seconds = 0.3  # the ranks are done long before step 1's rollouts: nothing more
    pipeline.beside(0, lambda: None)
    assert sorted(pipeline.pending) == [1]
    engines.seconds = 0.0
    both = threading.Event()

    def slow_training():  # training outlasts two generations: the engines run ahead
        while len(engines.calls) < 4:
            both.wait(0.01)

    pipeline.take(1, 1)
    pipeline.beside(1, slow_training)
    assert sorted(pipeline.pending)[:2] == [2, 3]
    pipeline.close()


def test_pending_rollouts_survive_a_checkpoint_folder_bit_for_bit(tmp_path):
    pipeline, engines = _pipeline(2)
    pipeline.take(0, 0)
    pipeline.beside(0, lambda: None)
    state = pipeline.save(tmp_path)
    assert state == {"pending_steps": [1, 2], "published_versions": [0]}
    restored, _ = _pipeline(2)
    restored.restore(tmp_path, state)
    assert sorted(restored.pending) == [1, 2]
    for step in (1, 2):
        a, b = pipeline.pending[step], restored.pending[step]
        assert (a.rewards, a.metrics, a.parity) == (b.rewards, b.metrics, b.parity)
        for x, y in zip(a.completions, b.completions, strict=True):
            assert torch.equal(x.logprobs, y.logprobs)
            fields = ("prompt_ids", "token_ids", "weight_version", "prompt_index", "sample_index")
            assert [getattr(x, f) for f in fields] == [getattr(y, f) for f in fields]
    pipeline.close()
    restored.close()
