"""Step progress: a bar on a terminal, one plain log line per step otherwise."""

from __future__ import annotations


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
