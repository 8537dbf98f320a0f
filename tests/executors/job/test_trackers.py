"""Experiment trackers: a row's numeric fields (bools 0/1, text left out) go to every backend
under the same names (MLflow's alphabet aside: '@' -> '_at_'); jsonl always writes
metrics.jsonl; a missing tracker package is a config error naming the backend and what to
install; TensorBoard writes event files into RUN_DIR/tensorboard/."""

from __future__ import annotations

import pytest

from rl_engine.config import LoggingConfig, RunConfig
from rl_engine.executors.job import trackers
from rl_engine.executors.job.run_dir import read_metrics
from rl_engine.executors.job.trackers import Trackers, check_backends, mlflow_name, scalars


def test_scalars_keep_numbers_and_bools_and_drop_step_and_text():
    row = {"step": 2, "loss": 0.5, "tokens": 48, "skipped": True, "skip_reason": "no reward"}
    assert scalars(row) == {"loss": 0.5, "tokens": 48.0, "skipped": 1.0}
    assert all(type(v) is float for v in scalars(row).values())


def test_mlflow_names_replace_at_and_characters_outside_its_alphabet():
    assert mlflow_name("eval/pass@k") == "eval/pass_at_k"
    assert mlflow_name("time/step") == "time/step"
    assert mlflow_name("parity/max_abs_diff") == "parity/max_abs_diff"
    assert mlflow_name("a+b(c)") == "a_b_c_"


def test_a_missing_package_names_the_backend_and_the_install(monkeypatch):
    monkeypatch.setitem(
        trackers.PACKAGES, "tensorboard", ("rl_engine_no_such_package", "pip install it")
    )
    with pytest.raises(ValueError, match=r"logging.backends names 'tensorboard'") as err:
        check_backends(["jsonl", "tensorboard"])
    assert "rl_engine_no_such_package package is not installed: pip install it" in str(err.value)
    check_backends(["jsonl"])  # jsonl needs no package


def test_jsonl_tracker_writes_each_row_to_metrics_jsonl(tmp_path):
    config = RunConfig(logging=LoggingConfig(backends=["jsonl"]))
    run = Trackers(config, tmp_path, first_step=0)
    rows = [{"step": 0, "loss": 1.0, "skip_reason": ""}, {"step": 1, "loss": 0.5}]
    for row in rows:
        run.log(row)
    run.close()
    assert read_metrics(tmp_path) == rows
    assert run.backends == []


def test_tensorboard_tracker_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    config = RunConfig(logging=LoggingConfig(backends=["jsonl", "tensorboard"]))
    run = Trackers(config, tmp_path, first_step=0)
    run.log({"step": 0, "loss": 1.0})
    run.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert [m["loss"] for m in read_metrics(tmp_path)] == [1.0]
