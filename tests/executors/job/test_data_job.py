"""Jobs on a verl-layout parquet dataset with a verl reward file: validation in the step rows,
TensorBoard / W&B / MLflow, eval on == eval off, resume, and config errors before Ray.

The model is a tiny real Llama saved with a word-level tokenizer and a chat template
(tests/helpers/chat_model.py); the parquet files are written by HF `datasets` as verl's
preprocessing scripts write them.
"""

from __future__ import annotations

import json

import pytest

from rl_engine.cli import main
from rl_engine.config import RunConfig
from rl_engine.executors.job.faults import JobStopped
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import resume_config
from tests.helpers.chat_model import save_chat_model
from tests.helpers.data import verl_rows, write_parquet
from tests.helpers.job.jobs import without_timings, write_config

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "boom":
        raise ValueError("no score for this row")
    words = solution_str.split()
    return {"score": float(ground_truth in words), "length": float(len(words))}
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_job")
    train = verl_rows(6, "toy/add") + verl_rows(4, "toy/more")
    val = verl_rows(3, "toy/add") + verl_rows(2, "toy/more")
    val[4]["reward_model"]["ground_truth"] = "boom"
    (root / "reward.py").write_text(REWARD_FILE)
    return {
        "root": root,
        "model": str(save_chat_model(root / "model")),
        "train": write_parquet(root / "train.parquet", train),
        "val": write_parquet(root / "val.parquet", val),
        "reward": str(root / "reward.py"),
    }


def data_config(files, run_dir, *, steps=3, evaluate=True, backends=("jsonl",), **reward):
    data = {"train_files": files["train"], "max_prompt_length": 64}
    if evaluate:
        data["val_files"] = files["val"]
    return RunConfig.from_dict(
        {
            "model": files["model"],
            "seed": 3,
            "output_dir": str(run_dir),
            "steps": steps,
            "rollout": {
                "max_batch_size": 4,
                "prompts_per_step": 2,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
            },
            "trainer": {"micro_batch_size": 4, "lr": 1e-2},
            "data": data,
            "reward": {"function": f"{files['reward']}:compute_score", **reward},
            "eval": {"every": 2, "samples_per_prompt": 2, "temperature": 1.0} if evaluate else {},
            "logging": {"backends": list(backends)},
        }
    )


def installed_backends() -> list[str]:
    import importlib.util

    optional = [b for b in ("wandb", "mlflow") if importlib.util.find_spec(b) is not None]
    return ["jsonl", "tensorboard", *optional]


@pytest.fixture(scope="module")
def whole(files, tmp_path_factory, module_job_ray):
    """3 steps with validation, every installed tracker and one Ray reward worker."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        history = run_job(data_config(files, run_dir, backends=installed_backends(), num_workers=1))
    return run_dir, history


@pytest.mark.slow  # one 3-step job (the fixture)
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # a loaded shared machine: jobs of a few seconds' compute take minutes
def test_dataset_job_evaluates_into_the_step_rows_and_logs_to_every_tracker(whole):
    run_dir, history = whole
    # validation rows: initial eval in row 0, after step 1 (every 2), final in the last row
    assert [m["step"] for m in history] == [0, 1, 2]
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] > 0
        assert m["eval/num_prompts"] == 5 and m["eval/reward_errors"] == 2  # k = 2 x the boom row
        for key in ("eval/reward_mean", "eval/pass@k", "eval/mean@k", "eval/pass@2"):
            assert 0.0 <= m[key] <= 1.0, key
        assert m["eval/pass@k"] >= m["eval/mean@k"] and 0 < m["eval/response_length"] <= 6
        assert "eval/toy/add/reward_mean" in m and "eval/toy/more/pass@k" in m
        assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0 and m["data/epoch"] == 0
        assert m["reward/extra/length"] > 0 and m["time/eval"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"][0]["eval/reward_mean"] == history[0]["eval/reward_mean"]
    _check_tensorboard(run_dir, history)
    if "wandb" in installed_backends():
        _check_wandb(run_dir, runs=1)
    if "mlflow" in installed_backends():
        _check_mlflow(run_dir, history)


@pytest.mark.slow  # one more 3-step job
@pytest.mark.exhaustive
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_eval_on_equals_eval_off_on_every_training_metric(files, whole, tmp_path):
    """Eval samples with seeds of its own and moves no prompt cursor: the training rows match."""
    plain = tmp_path / "plain"
    run_job(data_config(files, plain, evaluate=False))
    training = [
        {k: v for k, v in m.items() if not k.startswith("eval/")} for m in without_timings(whole[0])
    ]
    assert without_timings(plain) == training
    assert all(not any(k.startswith("eval/") for k in m) for m in without_timings(plain))


@pytest.mark.slow  # a 2-step job and its resume
@pytest.mark.exhaustive  # make test resumes a run in test_job_lifecycle
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_stopped_and_resumed_dataset_run_equals_the_whole_one(files, whole, tmp_path, monkeypatch):
    """The same rows, eval included; the prompt cursor is in the checkpoint; trackers continue."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    backends = installed_backends()
    part = tmp_path / "part"
    run_job(data_config(files, part, steps=2, backends=backends))
    state = json.loads((part / "checkpoints" / "step000002" / "state.json").read_text())
    assert state["driver"]["prompt_position"] == 4
    run_job(resume_config(part, None, ["steps=3"]), resume=True)
    assert without_timings(part) == without_timings(whole[0])
    _check_tensorboard(part, whole[1])
    if "wandb" in backends:
        _check_wandb(part, runs=2)


def _check_tensorboard(run_dir, history):
    """The event files read back: every numeric metric a scalar tag, one value per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("reward_mean", "eval/reward_mean", "eval/pass@k", "parity/exact_match_fraction"):
        assert tag in tags, sorted(tags)
    assert [e.step for e in events.Scalars("eval/pass@k")] == [0, 1, 2]
    values = [e.value for e in events.Scalars("reward_mean")]
    assert values == pytest.approx([m["reward_mean"] for m in history])  # float32 in TB files


def _check_wandb(run_dir, runs: int):
    """An offline run directory per start, all with the run id kept in trackers.json."""
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb_run_id"]
    offline = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == runs
    assert all((d / f"run-{run_id}.wandb").stat().st_size > 0 for d in offline)


def _check_mlflow(run_dir, history):
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    points = client.get_metric_history(run_id, "eval/pass_at_k")  # MLflow forbids '@'
    assert [p.step for p in points] == [0, 1, 2]
    assert [p.value for p in points] == [m["eval/pass@k"] for m in history]
    assert client.get_run(run_id).data.params["reward.num_workers"] == "1"


@pytest.mark.multiprocess
def test_a_failing_reward_under_on_error_fail_stops_the_job(files, tmp_path, job_ray):
    config = data_config(files, tmp_path / "run", steps=1, on_error="fail")
    with pytest.raises(JobStopped) as stopped:
        run_job(config)
    assert stopped.value.exit_code == 1
    assert "ValueError: no score for this row" in str(stopped.value)
    assert "reward.on_error: fail" in str(stopped.value)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"].startswith("failed")


def _cli(config: RunConfig, path) -> int:
    return main(["train", "--config", str(write_config(config, path))])


def test_config_errors_exit_2_before_ray_starts(files, tmp_path, caplog, monkeypatch):
    import importlib.util

    good = data_config(files, tmp_path / "run").to_dict()
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in verl_rows(2)]
    no_answer = write_parquet(tmp_path / "noanswer.parquet", rows)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 garbage")
    cases = [
        ({"data": {"train_files": no_answer}}, "noanswer.parquet has no column 'reward_model'"),
        ({"data": {"val_files": str(broken)}}, "broken.parquet' is not a readable parquet"),
        ({"reward": {"function": "missing.py:compute_score"}}, "missing.py' does not exist"),
        ({"model": "tiny-llama"}, "data.train_files needs a model with a tokenizer"),
        ({"rollout": {"task": "arithmetic"}}, "data.train_files and rollout.task 'arithmetic'"),
    ]
    for change, message in cases:
        data = json.loads(json.dumps(good))
        for section, values in change.items():
            data[section] = {**data[section], **values} if isinstance(values, dict) else values
        caplog.clear()
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps(data))
        assert main(["train", "--config", str(path)]) == 2
        assert message in caplog.text, caplog.text
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # the one error path an installed wandb cannot produce
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a),
    )
    caplog.clear()
    config = data_config(files, tmp_path / "run", backends=("jsonl", "wandb"))
    assert _cli(config, tmp_path / "w.yaml") == 2
    assert "pip install 'rl-engine[wandb]'" in caplog.text
    # run_job checks before it prepares the run directory, and only then starts Ray
    assert not (tmp_path / "run").exists()
