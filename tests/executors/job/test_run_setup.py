"""Everything the driver decides before Ray starts: config errors, --set, run directories,
resume rules, checkpoint layout, kernel-fact comparison. No Ray, no DeepSpeed: each case
must fail with exit code 2 and one line on stderr, before Ray starts."""

from __future__ import annotations

import json
import stat

import pytest
import ray
import yaml

from rl_engine.cli import main
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.cluster import ClusterError, check_same_kernels, kernel_facts
from rl_engine.executors.job.run_dir import (
    MetricsLog,
    RunDirError,
    prepare_run_dir,
    read_metrics,
    resume_config,
    truncate_metrics,
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


def _train_fails(argv, caplog) -> str:
    """The one-line error `rl-engine train ARGV` logs (stderr outside pytest) with exit code 2."""
    caplog.clear()
    assert main(["train", *argv]) == 2
    assert not ray.is_initialized()  # refused before Ray started
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


def test_metrics_log_appends_and_resume_drops_later_steps(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(4):
        log.append({"step": step, "loss": 0.5 * step})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a crash while writing the last line
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert [m["step"] for m in truncate_metrics(tmp_path, 2)] == [0, 1]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == 0o644


def test_checkpoint_is_latest_only_once_complete_and_old_ones_are_pruned(tmp_path):
    import torch

    from rl_engine.config import RunConfig

    config = RunConfig()
    for step in (1, 2, 3):
        staging = ckpt.begin(tmp_path, step)
        save_state_dict(staging / WEIGHTS_FILE, {"w": torch.full((2,), float(step))})
        ckpt.write_driver_part(
            staging,
            step=step,
            weight_version=step,
            config=config,
            weights_only=True,
        )
        assert ckpt.latest(tmp_path) is None or ckpt.latest(tmp_path).step == step - 1
        ckpt.commit(tmp_path, staging, keep_last=2)
    assert ckpt.complete_tags(tmp_path) == ["step000002", "step000003"]
    assert ckpt.latest(tmp_path).step == 3 and ckpt.latest(tmp_path).weights_only
    assert torch.equal(ckpt.at_step(tmp_path, 2).load_weights()["w"], torch.full((2,), 2.0))
    ckpt.begin(tmp_path, 4)  # a save that never finished
    assert ckpt.latest(tmp_path).step == 3
    with pytest.raises(ValueError, match=r"checkpoints at steps \[2, 3\]"):
        ckpt.at_step(tmp_path, 1)


def test_kernel_facts_differences_are_named():
    here = kernel_facts("cpu")
    assert here["torch"] and here["cpu_capability"]
    check_same_kernels({"trainer rank 0": here, "rollout engine 0": dict(here)})
    # Two CPU types cannot be produced on one machine: the second node's facts are edited.
    other = {**here, "cpu_flags": here["cpu_flags"].replace("amx_bf16", "") + " avx512_fp16"}
    with pytest.raises(
        ClusterError, match="cpu_flags .* on trainer rank 0 but .* on rollout engine 1"
    ):
        check_same_kernels({"trainer rank 0": here, "rollout engine 1": other})


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise(caplog, capsys):
    from rl_engine.executors.job.progress import StepProgress

    record = {
        "step": 4,
        "reward_mean": 0.25,
        "parity/exact_match_fraction": 1.0,
        "parity/max_abs_diff": 0.0,
        "parity/num_tokens": 48,
        "loss": 0.5,
        "kl": 0.0,
        "time/step": 0.2,
    }
    caplog.set_level("INFO", logger="rl_engine.job")
    plain = StepProgress(10, 4, tty=False)
    plain.update(record)
    plain.close()
    assert "step   4 | reward 0.250 | parity exact 1.0000" in caplog.text
    bar = StepProgress(10, 4, tty=True)
    bar.update(record)
    bar.close()
    err = capsys.readouterr().err
    assert "5/10" in err and "reward=0.250" in err and "parity=1.0000" in err


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
