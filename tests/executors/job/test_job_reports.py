"""What a run leaves for people: summary.json holds the config, status, every step's metrics and
the actors; training.png is drawn from the history; a stopped run names its last checkpoint and
the exact resume command (shell-quoted)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict

from rl_engine.config import RunConfig
from rl_engine.executors.job.faults import ActorInfo
from rl_engine.executors.job.job_checkpoints import Checkpoint
from rl_engine.executors.job.job_reports import after_stop_note, resume_command, write_summary


def test_resume_command_quotes_the_run_dir(tmp_path):
    run = tmp_path / "my run"
    command = resume_command(run)
    assert shlex.split(command) == ["rl-engine", "train", "--resume", str(run)]


def test_after_stop_note_names_the_checkpoint_or_says_there_is_none(tmp_path):
    ckpt = Checkpoint(tmp_path / "checkpoints" / "step000003", 3, 3, weights_only=False)
    note = after_stop_note(tmp_path, ckpt)
    assert note.startswith("last checkpoint step000003 is intact")
    assert note.endswith(resume_command(tmp_path))
    assert after_stop_note(tmp_path, None).startswith("no checkpoint was written yet")


def test_summary_holds_config_status_steps_and_actors_and_a_plot(tmp_path):
    config = RunConfig()
    history = [
        {
            "step": 0,
            "reward_mean": 0.25,
            "parity/exact_match_fraction": 1.0,
            "eval/reward_mean": 0.5,
        },
        {"step": 1, "reward_mean": 0.5, "parity/exact_match_fraction": 1.0},
    ]
    actor = ActorInfo("trainer rank", 0, handle=object(), node_ip="10.0.0.1", pid=7)
    write_summary(tmp_path, config, "completed", history, [actor])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps"] == history
    assert summary["config"] == json.loads(json.dumps(asdict(config)))
    assert summary["actors"] == [actor.as_dict()]
    png = tmp_path / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp.png"))


def test_no_plot_without_history(tmp_path):
    write_summary(tmp_path, RunConfig(), "failed", [], [])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == []
    assert not (tmp_path / "training.png").exists()
