"""The run directory's metrics log: appended line by line, a torn last line is ignored on
read, and resuming drops the steps after the checkpoint."""

from __future__ import annotations

import stat

from rl_engine.executors.job.run_dir import MetricsLog, read_metrics, truncate_metrics


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
