"""Small real jobs for the driver tests: configs, a CLI subprocess, metrics without timings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ray
import yaml

from rl_engine.config import RunConfig
from rl_engine.executors.job import cluster
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import read_metrics, resume_config

REPO = Path(__file__).resolve().parents[3]


SHARED_RAY_CPUS = 6  # the largest job that shares it: PPO's 2 policy + 2 critic ranks + 1 engine
# the shared cluster's GCS address, and whether the running test asked for it
_shared = {"address": None, "asked": False}


def shared_ray() -> str:
    """The `job_ray` fixture's body: one local Ray cluster per pytest process, started by the
    first job test that asks for it and kept for the rest of the session (a cluster's start is
    4-9 s of CPU, more than a tiny job's steps); returns its address, for a job in another
    process (the CLI) to join. A job that finds Ray initialized joins it and never shuts it
    down (`cluster.connect`). The tests that did not ask for it see Ray as before, not
    initialized, where it matters: an in-process job of theirs finds the cluster shut down
    (`_connect_without_the_shared_cluster`), and a test marked `own_ray` starts with it shut
    down (tests/conftest.py). (A cluster that outlives the driver's connection,
    `ray.cluster_utils.Cluster`, was tried: after a reconnect in the same process Ray 2.60
    cancelled the next job's actor creations, "all references to the actor were removed".)"""
    if not ray.is_initialized():
        os.environ.pop("RAY_ADDRESS", None)
        ray.init(
            address="local",
            num_cpus=SHARED_RAY_CPUS,
            include_dashboard=False,
            log_to_driver=False,
        )
        _shared["address"] = ray.get_runtime_context().gcs_address
    # a module fixture's job runs before the test's own fixtures say that it asked
    _shared["asked"] = True
    return ray.get_runtime_context().gcs_address


def set_test_asked_for_ray(asked: bool) -> None:
    """tests/conftest.py says, before each test, whether it asked for the shared cluster."""
    _shared["asked"] = asked


def _connected_to_shared_ray() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared["address"]


def _connect_without_the_shared_cluster(connect):
    """`cluster.connect` for an in-process job of a test that did not ask for the shared
    cluster: the job starts its own, as it would in a fresh process, instead of joining the
    shared one unsized; the shared cluster is shut down at that moment (the next test that asks
    starts it again). A cluster the test connected to itself (`own_ray`) is the one its job
    must join, and stays."""

    def guarded(config) -> bool:
        if not _shared["asked"] and _connected_to_shared_ray():
            ray.shutdown()
        return connect(config)

    return guarded


cluster.connect = _connect_without_the_shared_cluster(cluster.connect)


def job_config(run_dir: Path, *, steps: int = 3, **sections) -> RunConfig:
    """A tiny-llama job of a few seconds; `sections` update the rollout/trainer/checkpoint keys."""
    data = {
        "model": "tiny-llama",
        "dtype": "float32",
        "seed": 3,
        "parity": "strict",
        "output_dir": str(run_dir),
        "steps": steps,
        "rollout": {
            "num_engines": 1,
            "max_batch_size": 4,
            "prompts_per_step": 2,
            "samples_per_prompt": 4,
            "max_new_tokens": 6,
        },
        "trainer": {"micro_batch_size": 4, "lr": 1e-2},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return RunConfig.from_dict(data)


def stopped_and_resumed(run_dir: Path, steps: int = 3, **sections) -> Path:
    """`run_dir` of a `steps`-step job stopped one step early (its checkpoint) and resumed."""
    run_job(job_config(run_dir, steps=steps - 1, **sections))
    assert ckpt.latest(run_dir).step == steps - 1
    run_job(resume_config(run_dir, None, [f"steps={steps}"]), resume=True)
    return run_dir


def resumed_copy(run_dir: Path, copy: Path, step: int, overrides: tuple[str, ...] = ()) -> Path:
    """A copy of the finished `run_dir` cut back to its checkpoint of `step` (the later ones
    deleted) and resumed to the end with `overrides`: one job start fewer than a run stopped
    at `step` and resumed, for tests whose subject is not the stop itself."""
    shutil.copytree(run_dir, copy)
    root = copy / ckpt.CHECKPOINTS
    for later in ckpt.complete_tags(copy):
        if later > ckpt.tag_for(step):  # zero-padded tags sort as their steps
            shutil.rmtree(root / later)
    (root / ckpt.LATEST).write_text(ckpt.tag_for(step) + "\n")
    assert ckpt.latest(copy).step == step
    run_job(resume_config(copy, None, list(overrides)), resume=True)
    return copy


def check_complete_run(run: Path, history: list[dict], num_ranks: int) -> None:
    """Every step exact (max |dlogp| 0 over > 0 tokens), every file in place, no temporaries."""
    assert [m["step"] for m in history] == [m["step"] for m in read_metrics(run)]
    for m in history:
        assert m["parity/max_abs_diff"] == 0.0 and m["parity/num_tokens"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == history
    assert summary["config"]["trainer"]["num_ranks"] == num_ranks
    actors = json.loads((run / "actors.json").read_text())
    assert len(actors) == num_ranks + 1
    for actor in actors:  # the environment each actor set itself (cluster.actor_env)
        env = actor["env"]
        assert env["DS_ACCELERATOR"] == "cpu" and env["TRANSFORMERS_VERBOSITY"] == "error"
        assert env["TORCH_EXTENSIONS_DIR"] == os.environ["TORCH_EXTENSIONS_DIR"], actor
    assert (run / "training.png").is_file() and (run / "config.yaml").is_file()
    assert not list(run.rglob(".*.tmp")), "atomic writes left temporary files behind"


def without_timings(run_dir: Path) -> list[dict]:
    """metrics.jsonl with every wall-clock field (the `time/` keys) removed."""
    return [
        {k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(run_dir)
    ]


def start_cli(args: list[str], log_path: Path, ray_address: str | None = None) -> subprocess.Popen:
    """`rl-engine ...` in a new session (so a test can signal its whole process group); with
    `ray_address` its job joins that cluster (RAY_ADDRESS), else it starts its own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.Popen(
        [sys.executable, "-m", "rl_engine.cli", *args],
        env=env,
        cwd=REPO,
        stdout=open(log_path, "w"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def write_config(config: RunConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return path


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def actor_pid(run_dir: Path, role: str, rank: int) -> int:
    actors = json.loads((run_dir / "actors.json").read_text())
    return next(a["pid"] for a in actors if a["role"] == role and a["rank"] == rank)
