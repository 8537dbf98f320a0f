"""Everything the driver decides before Ray starts: config errors, --set, run directories,
resume rules. No Ray, no DeepSpeed: each case
must fail with exit code 2 and one line on stderr, before Ray starts."""

from __future__ import annotations

import json

import pytest
import yaml

from rl_engine.cli import main
from rl_engine.executors.job import cluster
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.run_dir import (
    RunDirError,
    prepare_run_dir,
    resume_config,
)
from rl_engine.executors.worker.weights.weights_file import WEIGHTS_FILE, save_state_dict

BASE = {
    "model": "tiny-llama",
    "steps": 2,
    "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 4},
    "trainer": {"micro_batch_size": 4},
}


def _write_config(tmp_path, **changes) -> str:
    data = json.loads(json.dumps(BASE))
    data["output_dir"] = str(tmp_path / "run")
    for key, value in changes.items():
        section, _, leaf = key.rpartition("__")
        (data.setdefault(section, {}) if section else data)[leaf] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(autouse=True)
def _ray_never_starts(monkeypatch):
    """Every refusal here comes before Ray: a run that reaches the cluster fails its test."""

    def connect(config):
        raise AssertionError("the run reached Ray: its config was not refused before it")

    monkeypatch.setattr(cluster, "connect", connect)


def _train_fails(argv, caplog) -> str:
    """The one-line error `rl-engine train ARGV` logs (stderr outside pytest) with exit code 2."""
    caplog.clear()
    assert main(["train", *argv]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


def test_a_config_error_is_one_line_on_stderr_and_exit_2(tmp_path):
    """The real command in a fresh process: stderr holds exactly that one line."""
    import subprocess
    import sys

    config = _write_config(tmp_path, trainer__micro_batch_size=3)
    done = subprocess.run(
        [sys.executable, "-m", "rl_engine.cli", "train", "--config", config],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "multiple of trainer.micro_batch_size" in lines[0], done.stderr


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"model": "tiny-llamma"}, "unknown model spec 'tiny-llamma'"),
        ({"model": "/no/such/folder"}, "does not exist"),
        ({"trainer__deepspeed": "/no/such/ds.json"}, "DeepSpeed config file '/no/such/ds.json'"),
        ({"trainer__micro_batch_size": 3}, "multiple of trainer.micro_batch_size"),
        ({"rollout__task": "no_such_module_xyz:reward"}, "cannot import module"),
        ({"rollout__task": "sum"}, "unknown rollout.task 'sum'"),
        ({"rollout__task": "arithmetic"}, "needs a model with a tokenizer"),
        ({"algorithm__name": "a2c"}, "algorithm.name must be one of ['grpo', 'ppo']"),
    ],
)
def test_config_errors_are_one_line_before_ray(tmp_path, caplog, changes, expected):
    err = _train_fails(["--config", _write_config(tmp_path, **changes)], caplog)
    assert expected in err


def test_deepspeed_json_with_invalid_stage(tmp_path, caplog):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 5}}')
    err = _train_fails(["--config", _write_config(tmp_path, trainer__deepspeed=str(ds))], caplog)
    assert "zero_optimization.stage must be 0, 1, 2 or 3, got 5" in err


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, caplog):
    path = tmp_path / "broken.yaml"
    path.write_text("model: tiny-llama\nrollout:\n  num_engines: [1, 2\n  task: count\n")
    err = _train_fails(["--config", str(path)], caplog)
    assert f"{path}:4:" in err and "YAML syntax error" in err


def test_unwritable_output_dir(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = _write_config(tmp_path, output_dir=str(blocker / "run"))
    assert "is not writable" in _train_fails(["--config", config], caplog)


def test_set_overrides_dotted_keys_parsed_as_yaml(tmp_path, caplog):
    from rl_engine.config import RunConfig

    config = RunConfig.from_yaml(
        _write_config(tmp_path), ["trainer.lr=1e-5", "steps=7", "checkpoint.every=2"]
    )
    assert (config.trainer.lr, config.steps, config.checkpoint.every) == (1e-5, 7, 2)
    err = _train_fails(["--config", _write_config(tmp_path), "--set", "trainer.lr=-1"], caplog)
    assert "trainer.lr must be" in err
    err = _train_fails(["--config", _write_config(tmp_path), "--set", "trainer.lrr=1"], caplog)
    assert "trainer.lrr" in err
    assert "expected key=value" in _train_fails(
        ["--config", _write_config(tmp_path), "--set", "steps"], caplog
    )


def test_existing_run_dir_is_refused_without_resume_or_overwrite(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 1\n")
    err = _train_fails(["--config", _write_config(tmp_path)], caplog)
    assert "already exists" in err and "--resume" in err and "--overwrite" in err
    assert prepare_run_dir(run, resume=False, overwrite=True) == run and not any(run.iterdir())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("precious")
    with pytest.raises(RunDirError, match="holds files but no run"):
        prepare_run_dir(tmp_path / "other", resume=False, overwrite=True)
    with pytest.raises(RunDirError, match="no run there"):
        prepare_run_dir(tmp_path / "other", resume=True, overwrite=False)


def test_resume_config_allows_only_raising_steps(tmp_path):
    from rl_engine.config import RunConfig

    path = _write_config(tmp_path)
    run = tmp_path / "run"
    RunConfig.from_yaml(path).to_yaml(run / "config.yaml")
    assert resume_config(run, None, ["steps=5"]).steps == 5
    assert resume_config(run, path, ["steps=4"]).steps == 4
    assert resume_config(run, None, []).output_dir == str(run)
    with pytest.raises(RunDirError, match=r"trainer\.lr \(1e-05 in the run, 0.1 given\)"):
        resume_config(run, None, ["trainer.lr=0.1"])
    with pytest.raises(RunDirError, match="steps may only be raised"):
        resume_config(run, path, ["steps=1"])


def test_weights_only_checkpoint_cannot_resume(tmp_path, caplog):
    import torch

    from rl_engine.config import RunConfig

    run = tmp_path / "run"
    config = RunConfig.from_yaml(_write_config(tmp_path))
    config.to_yaml(run / "config.yaml")
    staging = ckpt.begin(run, 2)
    save_state_dict(staging / WEIGHTS_FILE, {"w": torch.zeros(1)})
    ckpt.write_driver_part(
        staging,
        step=2,
        weight_version=2,
        config=config,
        weights_only=True,
    )
    ckpt.commit(run, staging, keep_last=1)
    err = _train_fails(["--resume", str(run)], caplog)
    assert "weights-only checkpoint" in err and "cannot resume" in err
