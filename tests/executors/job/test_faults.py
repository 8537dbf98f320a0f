"""The driver's fault vocabulary without a cluster: an actor's name and one-line description,
error text cut to its first meaningful line, the weight-sync kill switch's parsing, and
SIGINT / SIGTERM turned into a stop at the end of the step (a second signal stops at once)."""

from __future__ import annotations

import os
import signal

import pytest

from rl_engine.executors.job.faults import (
    KILL_IN_WEIGHT_SYNC_ENV,
    ActorInfo,
    JobStopped,
    StopOnSignal,
    first_line,
    weight_sync_kill_switch,
)


def test_actor_info_names_role_rank_and_tp_rank():
    plain = ActorInfo("trainer rank", 1, handle=None, node_ip="10.0.0.2", node_id="abcdef123456")
    plain.pid = 4242
    assert plain.name == "trainer rank 1"
    assert plain.describe() == "trainer rank 1 (node 10.0.0.2 abcdef12, pid 4242)"
    assert "tp_rank" not in plain.as_dict()
    assert plain.as_dict()["pid"] == 4242 and plain.as_dict()["node_id"] == "abcdef123456"
    tp = ActorInfo("rollout engine", 0, handle=None, tp_rank=1)
    assert tp.name == "rollout engine 0 tp rank 1"
    assert tp.describe() == "rollout engine 0 tp rank 1 (node ? ?, pid None)"
    assert tp.as_dict()["tp_rank"] == 1


def test_first_line_skips_ray_frames_and_cuts_long_lines():
    assert first_line("\n  ValueError: bad lr  \nTraceback ...\n") == "ValueError: bad lr"
    # A RayTaskError's text starts with the `ray::Actor.method()` frame: the cause is last.
    assert first_line("ray::Trainer.step()\n  File x\nRuntimeError: boom") == "RuntimeError: boom"
    assert first_line("") == ""
    cut = first_line("x" * 400, limit=20)
    assert cut == "x" * 17 + "..." and len(cut) == 20


def test_kill_switch_is_armed_only_for_the_named_actor_and_a_numeric_version(monkeypatch):
    monkeypatch.delenv(KILL_IN_WEIGHT_SYNC_ENV, raising=False)
    assert weight_sync_kill_switch("rollout engine 0") is None
    monkeypatch.setenv(KILL_IN_WEIGHT_SYNC_ENV, "rollout engine 0@2")
    assert callable(weight_sync_kill_switch("rollout engine 0"))
    assert weight_sync_kill_switch("rollout engine 1") is None
    monkeypatch.setenv(KILL_IN_WEIGHT_SYNC_ENV, "rollout engine 0@two")
    assert weight_sync_kill_switch("rollout engine 0") is None


def test_first_signal_requests_a_stop_second_stops_at_once():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_exits_130():
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.exit_code == 130


def test_job_stopped_carries_its_exit_code():
    err = JobStopped("SIGTERM: stopped after step 3", exit_code=143)
    assert err.exit_code == 143 and str(err) == "SIGTERM: stopped after step 3"
