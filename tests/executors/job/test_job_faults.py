"""Faults on a real job run through the CLI: a killed actor process, SIGTERM, Ctrl-C.

Each run is `rl-engine train` in its own session, joining the pytest process's shared local
Ray cluster (RAY_ADDRESS): the faults are the job's, and the cluster outlives each of them.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.faults import KILL_IN_WEIGHT_SYNC_ENV
from rl_engine.executors.job.run_dir import read_metrics
from tests.helpers.job.jobs import actor_pid, job_config, start_cli, wait_for, write_config

# each test runs `rl-engine train` once or twice: 25-60 s each
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.deadline]

STEPS = 30  # long enough to be stopped mid-run (about 0.1-0.3 s a step)


def _finish(proc, timeout=180) -> int:
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _resume(run_dir, log_path, ray_address: str) -> int:
    return _finish(start_cli(["train", "--resume", str(run_dir)], log_path, ray_address))


@pytest.mark.exhaustive  # make test kills an actor in the weight-sync test below
def test_killed_trainer_is_named_checkpoint_kept_and_run_resumes(tmp_path, shared_ray_address):
    run = tmp_path / "run"
    config = write_config(
        job_config(run, steps=STEPS, checkpoint={"every": 2}), tmp_path / "c.yaml"
    )
    proc = start_cli(["train", "--config", str(config)], tmp_path / "first.log", shared_ray_address)
    wait_for(lambda: ckpt.complete_tags(run), 240, proc, "the first checkpoint")
    pid = actor_pid(run, "trainer rank", 0)
    os.kill(pid, signal.SIGKILL)
    assert _finish(proc) == 1
    out = (tmp_path / "first.log").read_text()
    died = [line for line in out.splitlines() if line.startswith("rl-engine:")]
    assert died and re.search(rf"trainer rank 0 \(node \S+ \w+, pid {pid}\) died: \S", died[0])
    assert f"rl-engine train --resume {run}" in out
    kept = ckpt.latest(run)
    assert kept is not None and kept.step >= 2 and (kept.deepspeed_dir / "latest").is_file()
    assert (run / "summary.json").is_file() and "failed" in (run / "summary.json").read_text()
    done = len(read_metrics(run))
    assert done >= kept.step

    assert _resume(run, tmp_path / "resume.log", shared_ray_address) == 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in metrics)


@pytest.mark.parametrize(
    ("signum", "to_group", "code"),
    [
        (signal.SIGTERM, False, 143),
        pytest.param(signal.SIGINT, True, 130, marks=pytest.mark.exhaustive),
    ],
    ids=["sigterm", "ctrl-c"],
)
def test_signal_stops_at_end_of_step_with_checkpoint(
    tmp_path, shared_ray_address, signum, to_group, code
):
    """SIGTERM to the driver, or SIGINT to the whole process group as a terminal's Ctrl-C sends it."""
    run = tmp_path / "run"
    config = write_config(job_config(run, steps=STEPS), tmp_path / "c.yaml")
    proc = start_cli(["train", "--config", str(config)], tmp_path / "run.log", shared_ray_address)
    wait_for(lambda: read_metrics(run), 240, proc, "the first step")
    (os.killpg if to_group else os.kill)(proc.pid, signum)
    assert _finish(proc) == code
    out = (tmp_path / "run.log").read_text()
    steps = len(read_metrics(run))
    assert 0 < steps < STEPS, "the run was not stopped early"
    assert ckpt.latest(run).step == steps  # checkpoint of the last finished step
    assert f"stopped after step {steps - 1}" in out and f"rl-engine train --resume {run}" in out


@pytest.mark.parametrize(
    "victim", ["rollout engine 0", pytest.param("trainer rank 0", marks=pytest.mark.exhaustive)]
)
def test_actor_killed_during_a_weight_sync_is_named_and_the_run_resumes(
    tmp_path, shared_ray_address, monkeypatch, victim
):
    """The victim SIGKILLs itself after the first bucket of the sync to version 2 (step 1),
    while its partner is mid-transfer: the failure names the victim (not the partner that
    saw the connection close), the checkpoint after step 1 is kept, and --resume completes
    the run with parity 1.0 on every step."""
    run = tmp_path / "run"
    trainer = {"weight_sync_bucket_mb": 0.05}  # about 20 buckets of the tiny model
    config = write_config(
        job_config(run, steps=4, checkpoint={"every": 1}, trainer=trainer), tmp_path / "c.yaml"
    )
    monkeypatch.setenv(KILL_IN_WEIGHT_SYNC_ENV, f"{victim}@2")
    proc = start_cli(["train", "--config", str(config)], tmp_path / "first.log", shared_ray_address)
    assert _finish(proc) == 1
    monkeypatch.delenv(KILL_IN_WEIGHT_SYNC_ENV)
    out = (tmp_path / "first.log").read_text()
    role, rank = victim.rsplit(" ", 1)
    pid = actor_pid(run, role, int(rank))
    failed = [line for line in out.splitlines() if line.startswith("rl-engine:")]
    assert failed and re.search(
        rf"^rl-engine: {victim} \(node \S+ \w+, pid {pid}\) died: ", failed[0]
    )
    assert "in the weight sync to version 2" in failed[0]
    assert ckpt.latest(run).step == 1 and [m["step"] for m in read_metrics(run)] == [0]

    assert _resume(run, tmp_path / "resume.log", shared_ray_address) == 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(4))
    assert [m["weight_version"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in metrics)
