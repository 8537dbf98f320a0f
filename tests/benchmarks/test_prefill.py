"""`rl-engine bench rollout --case prefill` (rl_engine/benchmarks/prefill.py) at `--tiny`: a row
per prompt-length mix, padded against packed prefill.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import prefill
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number


def test_bench_rollout_prefill(capsys):
    (rows,) = bench(capsys, "rollout", "--case", "prefill")
    from rl_engine.benchmarks.prefill import MIXES

    assert [r["prompt lengths"] for r in rows] == list(MIXES)
    assert_figures(rows, times=("padded ms", "packed ms"), ratios=("packed / padded",))
    assert all(number(r["padded / real tokens"]) >= 1 for r in rows)
    assert {r["default"] for r in rows} <= {"packed", "padded"}


def test_the_case_runs_this_module():
    assert "prefill" in bench_modules("rollout", "prefill")
    assert callable(prefill.main)
