"""A step's metrics row: phases add up under `time/`, the driver's overhead is the step's time
less generation, training compute and validation, and the row puts the step and the mean reward
beside the trainer's metrics."""

from __future__ import annotations

import pytest

from rl_engine.executors.job.step_metrics import StepClock, step_record


def test_phases_accumulate_and_overhead_is_what_is_not_compute():
    clock = StepClock()
    clock.add("train_compute", 0.25)
    clock.add("train_compute", 0.5)
    clock.add("generate_compute", 0.125)
    with clock.phase("batch"):
        pass
    t = clock.totals()
    assert t["time/train_compute"] == 0.75
    assert t["time/batch"] >= 0.0
    assert t["time/driver_overhead"] == t["time/step"] - (0.125 + 0.75)
    assert t["time/driver_overhead_fraction"] == t["time/driver_overhead"] / t["time/step"]


def test_validation_counts_as_busy_time_and_generation_defaults_to_zero():
    clock = StepClock()
    clock.add("train_compute", 0.5)
    clock.add("eval", 2.0)
    t = clock.totals()
    assert t["time/generate_compute"] == 0.0
    assert t["time/driver_overhead"] == t["time/step"] - 2.5


def test_a_phase_that_raises_is_still_timed():
    clock = StepClock()
    with pytest.raises(RuntimeError), clock.phase("rollout"):
        raise RuntimeError("engine died")
    assert "time/rollout" in clock.times


def test_step_record_adds_step_reward_mean_extra_and_times():
    row = step_record(
        3,
        {"loss": 0.5, "kl": 0.0},
        [1.0, 0.0, 0.5, 0.5],
        {"eval/reward_mean": 0.75},
        {"time/step": 1.5},
    )
    assert row == {
        "loss": 0.5,
        "kl": 0.0,
        "step": 3,
        "reward_mean": 0.5,
        "eval/reward_mean": 0.75,
        "time/step": 1.5,
    }
