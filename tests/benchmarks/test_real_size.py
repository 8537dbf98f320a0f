"""The job benchmark (rl_engine/benchmarks/real_size.py, `rl-engine bench job`: two Ray jobs of
2 ZeRO-3 ranks) by its parts at the tiny shape: the model it saves (built once), the run
configs it writes for both modes and for LoRA; and its `--lora` comparison whole (slow).

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import argparse

import pytest

from rl_engine.benchmarks import real_size
from tests.helpers.bench_tables import assert_figures, bench_modules, number, tables


def test_bench_job_model_and_run_configs_at_tiny_size(tmp_path):
    """The saved tiny model loads, is built once, and the configs the bench writes for both
    modes are valid run configs."""
    from rl_engine.benchmarks import real_size
    from rl_engine.config import RunConfig
    from rl_engine.models import load_model

    path = real_size.model_dir(tmp_path, "qwen2.5-tiny", None, 0)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert real_size.model_dir(tmp_path, "qwen2.5-tiny", None, 0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not built again
    model, _ = load_model(str(path))
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == real_size.VOCAB
    args = argparse.Namespace(seed=0, **real_size.TINY_ARGS)
    for invariant in (True, False):
        config = RunConfig.from_dict(real_size.job_config(path, tmp_path / "run", invariant, args))
        assert config.batch_invariant is invariant
        assert config.trainer.num_ranks == 2 and config.trainer.zero_stage == 3
    lora = real_size.job_config(path, tmp_path / "run", True, args, lora_rank=16)
    config = RunConfig.from_dict(lora)
    assert (config.lora.rank, config.lora.alpha, config.lora.target_modules) == (
        16,
        32,
        "all-linear",
    )
    assert set(real_size.QWEN25) >= {"qwen2.5-0.5b", "qwen2.5-1.5b"} and real_size.VOCAB == 151936


@pytest.mark.multiprocess  # two Ray jobs of 2 ZeRO-3 ranks and an engine each
@pytest.mark.slow
@pytest.mark.exhaustive  # make test keeps the report's LoRA columns (test_bench_job_report_with_lora)
def test_bench_job_lora_beside_the_full_weight_run(tmp_path, capsys):
    """`--lora RANK` at the tiny shape: the LoRA run beside the full-weight invariant run, with
    memory, the train / generate / sync split and weight_sync/bytes (first and later syncs)
    for each, and the LoRA / full ratios; a LoRA run's later syncs move its adapters alone."""
    from rl_engine.benchmarks import real_size

    argv = ["--tiny", "--lora", "2", "--modes", "invariant"]
    assert real_size.main([*argv, "--out", str(tmp_path / "out"), "--cache", str(tmp_path)]) == 0
    (rows,) = tables(capsys.readouterr().out)
    by_title = {r[""]: r for r in rows}
    assert set(rows[0]) == {"", "invariant", "lora", "lora / full"}
    ratios = (
        "peak extra system memory GiB",
        "peak of the job's own memory GiB (PSS of its processes)",
        "train compute s",
        "weight_sync/bytes MiB, first sync",
        "weight_sync/bytes MiB, later syncs (median)",
    )
    for title in (*ratios, "generate compute s", "weight sync s (median, steps 1..)"):
        assert_figures([by_title[title]], memory=("invariant", "lora"))
    assert_figures([by_title[title] for title in ratios], ratios=("lora / full",))
    later = by_title["weight_sync/bytes MiB, later syncs (median)"]
    assert number(later["lora / full"]) < 0.1
    pss = [r for title, r in by_title.items() if title.startswith("PSS MiB at the job's peak")]
    assert {r[""].split(", ", 1)[1] for r in pss} >= {
        "driver",
        "trainer rank 0",
        "rollout engine 0",
    }
    assert_figures(pss, memory=("invariant", "lora"))
    assert by_title["parity exact-match per step"]["lora"] == "1, 1"


def test_the_case_runs_this_module():
    assert "real_size" in bench_modules("job", None)
    assert callable(real_size.main)
