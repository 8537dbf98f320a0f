"""The job benchmark's report (rl_engine/benchmarks/real_size_report.py): the environment, the
markdown table of both modes with their ratio, and a LoRA run's column with LoRA / full ratios."""

from __future__ import annotations

from tests.helpers.bench_tables import tables


def test_bench_job_report():
    from rl_engine.benchmarks.real_size_report import environment, markdown

    env = environment()
    assert env["cpus"] >= 1 and env["total_gib"] > 0
    figures = [
        {
            "mode": mode,
            "weight_sync_s": 0.5 * scale,
            "train_compute_s": 2.0 * scale,
            "generate_compute_s": 1.0 * scale,
            "step_s": 4.0 * scale,
            "peak_extra_gib": 1.5 * scale,
            "peak_job_pss_gib": 1.0 * scale,
            "peak_rss_mib": {"driver": 300.0, "trainer 0": 900.0 * scale},
            "driver_rss_during_steps_mib": [290.0, 310.0],
            "parity_exact": [1.0, 1.0] if mode == "invariant" else [0.25, None],
        }
        for mode, scale in (("invariant", 2.0), ("plain", 1.0))
    ]
    (rows,) = tables(markdown(figures, env, env, "label"))
    by_title = {r[""]: r for r in rows}
    assert by_title["step s"] == {
        "": "step s",
        "invariant": "8.0",
        "plain": "4.0",
        "ratio": "2.00x",
    }
    assert by_title["peak RSS MiB, trainer 0"]["invariant"] == "1800"
    assert by_title["parity exact-match per step"]["plain"] == "0.25, -"


def test_bench_job_report_with_lora():
    """A LoRA run's column and the LoRA / full ratios (lora over the invariant full run)."""
    from rl_engine.benchmarks.real_size_report import environment, markdown

    env = environment()
    figures = [
        {
            "mode": mode,
            "train_compute_s": 2.0 * scale,
            "peak_extra_gib": 4.0 * scale,
            "sync_first_mib": 100.0,
            "sync_later_mib": 100.0 * scale**4,
            "pss_at_peak_mib": {"driver": 300.0, "trainer rank 0": 900.0 * scale},
            "driver_rss_during_steps_mib": None,
            "parity_exact": [1.0],
        }
        for mode, scale in (("invariant", 1.0), ("plain", 1.0), ("lora", 0.25))
    ]
    (rows,) = tables(markdown(figures, env, env, "label"))
    by_title = {r[""]: r for r in rows}
    assert by_title["train compute s"] == {
        "": "train compute s",
        "invariant": "2.0",
        "plain": "2.0",
        "lora": "0.5",
        "ratio": "1.00x",
        "lora / full": "0.25x",
    }
    assert by_title["weight_sync/bytes MiB, first sync"]["lora / full"] == "1.00x"
    later = by_title["weight_sync/bytes MiB, later syncs (median)"]
    assert (later["lora"], later["lora / full"]) == ("0.391", "0.0039x")  # significant digits
    assert by_title["PSS MiB at the job's peak, trainer rank 0"]["lora"] == "225"
    assert by_title["step s"]["lora / full"] == "-"  # a figure a run does not have
