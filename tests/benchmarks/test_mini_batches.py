"""`rl-engine bench train --case mini-batches` (rl_engine/benchmarks/mini_batches.py) at
`--tiny`: one update, and two under parity_scope first and all.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import mini_batches
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number


def test_bench_train_mini_batches(capsys):
    (rows,) = bench(capsys, "train", "--case", "mini-batches")
    assert [r["updates"] for r in rows] == ["1", "2", "2"]
    assert rows[1]["step"].endswith("parity_scope first")
    assert number(rows[1]["vs parity_scope first"]) == 1.0
    assert_figures(rows, times=("s",), ratios=("vs parity_scope first",))


def test_the_case_runs_this_module():
    assert "mini_batches" in bench_modules("train", "mini-batches")
    assert callable(mini_batches.main)
