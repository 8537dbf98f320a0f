"""Scoring one sample (rl_engine/rewards/scoring.py): a verl reward file runs unchanged, its
result forms normalised to a score and numeric extras, a raise, a bad result or a timeout is a
score of zero counted in the metrics (or a RewardFailure under on_error 'fail'); and the Ray
worker pool that kills and replaces a worker whose reward never returns."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rl_engine.rewards import (
    RewardFailure,
    RewardSample,
    call_score,
    check_scores,
    load_reward_function,
    score_metrics,
)
from rl_engine.rewards.scoring import Score, normalize, time_limit

VERL_FILE = """
import re

def _last_number(text):
    found = re.findall(r"-?\\d+", text)
    return found[-1] if found else None

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "boom":
        raise RuntimeError("cannot score this one")
    if ground_truth == "slow":
        import time
        time.sleep(30)
    if ground_truth == "spin":
        while True:
            pass
    if ground_truth == "stuck":  # a C call the time-limit signal cannot interrupt
        import signal, time
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
        time.sleep(30)
    correct = _last_number(solution_str) == str(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": _last_number(solution_str)}

def two_args(solution_str, ground_truth):
    return 1.0
"""


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_FILE)
    return str(path)


def sample(solution: str, truth, source: str = "toy") -> RewardSample:
    return RewardSample(source, solution, truth, {"index": 0}, where=f"sample {truth}")


def test_a_verl_reward_file_runs_unchanged(verl_file):
    fn = load_reward_function(f"{verl_file}:compute_score")
    assert load_reward_function(verl_file) is fn  # the name defaults to compute_score
    right = call_score(fn, sample("so it is 12", "12"), {}, 5.0)
    wrong = call_score(fn, sample("so it is 13", "12"), {}, 5.0)
    assert (right.value, right.extras, right.ok) == (1.0, {"acc": 1.0}, True)  # 'pred' is text
    assert (wrong.value, wrong.extras) == (0.0, {"acc": 0.0})
    metrics = score_metrics([right, wrong])
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/extra/acc": 0.5}


def test_raises_bad_results_and_timeouts_are_scores_of_zero(verl_file):
    fn = load_reward_function(verl_file)
    boom = call_score(fn, sample("1", "boom"), {}, 5.0)
    assert boom.value == 0.0 and "RuntimeError: cannot score this one" in boom.error
    started = time.monotonic()
    slow = call_score(fn, sample("1", "slow"), {}, 0.5)  # time.sleep(30)
    spin = call_score(fn, sample("1", "spin"), {}, 0.5)  # a pure-Python endless loop
    assert time.monotonic() - started < 5
    assert slow.timed_out and spin.timed_out and slow.value == spin.value == 0.0
    assert call_score(fn, sample("5", "5"), {}, 5.0).value == 1.0  # the next sample runs normally
    nan = call_score(lambda **kw: float("nan"), sample("1", "1"), {}, 5.0)
    nodict = call_score(lambda **kw: {"acc": 1.0}, sample("1", "1"), {}, 5.0)
    text = call_score(lambda **kw: "1.0", sample("1", "1"), {}, 5.0)
    assert "non-finite" in nan.error and "without a 'score'" in nodict.error and "str" in text.error
    metrics = score_metrics([boom, slow, spin, nan])
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (2.0, 2.0)
    check_scores([boom], [sample("1", "boom")], "zero", "the reward")  # counted, not raised
    with pytest.raises(RewardFailure, match="the reward of sample boom .* RuntimeError"):
        check_scores([boom], [sample("1", "boom")], "fail", "the reward")


@pytest.mark.multiprocess
@pytest.mark.deadline  # a stuck worker is replaced at its timeout
def test_ray_pool_scores_in_order_and_replaces_a_stuck_worker(verl_file, job_ray):
    """Two workers; a reward blocking the time-limit signal cannot be interrupted inside its
    worker, so the driver kills that worker at timeout + grace and starts another."""
    from rl_engine.executors.job.reward_workers import KILL_GRACE_S, RewardPool

    pool = RewardPool(verl_file, {}, 1.0, 2)
    samples = [sample(str(i), str(i)) for i in range(4)]
    samples[1] = sample("1", "stuck")
    samples[2] = sample("2", "spin")
    samples.append(sample("9", "boom"))
    started = time.monotonic()
    scores = pool.score(samples)
    assert time.monotonic() - started < 1.0 + KILL_GRACE_S + 20
    assert [s.value for s in scores] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert scores[1].timed_out and "worker killed" in scores[1].error
    assert scores[2].timed_out and "worker killed" not in scores[2].error  # its own limit
    assert "RuntimeError" in scores[4].error and not scores[4].timed_out
    assert pool.replaced == 1 and len(pool.workers) == 2
    assert [s.value for s in pool.score([sample("3", "3")])] == [1.0]  # the new worker scores
    pool.close()


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (True, (1.0, {})),
        (3, (3.0, {})),
        (np.float32(0.5), (0.5, {})),
        (np.bool_(False), (0.0, {})),
        ({"score": 1, "acc": True, "pred": "7", "bad": float("inf")}, (1.0, {"acc": 1.0})),
    ],
)
def test_normalize_reads_verls_result_forms(result, expected):
    assert normalize(result) == expected


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        ({"acc": 1.0}, ValueError, r"without a 'score' key: \['acc'\]"),
        ("1.0", TypeError, "returned str '1.0', not a number"),
        (None, TypeError, "returned NoneType None"),
        (float("-inf"), ValueError, "non-finite score -inf"),
    ],
)
def test_normalize_names_what_is_wrong_with_a_result(result, error, message):
    with pytest.raises(error, match=message):
        normalize(result)


def test_score_metrics_count_errors_and_timeouts_apart_under_a_prefix():
    scores = [
        Score(0.0, error="E"),
        Score(0.0, timed_out=True, error="T"),
        Score(1.0, {"acc": 1.0}),
    ]
    assert score_metrics(scores, prefix="val/") == {
        "val/errors": 1.0,
        "val/timeouts": 1.0,
        "val/extra/acc": 1.0,
    }
    assert score_metrics([]) == {"reward/errors": 0.0, "reward/timeouts": 0.0}


def test_the_time_limit_is_off_outside_the_main_thread():
    """Signals reach only the main thread: a worker thread's reward runs without a limit."""
    done = []

    def run():
        with time_limit(0.01):
            time.sleep(0.1)
        done.append(True)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert done == [True]
