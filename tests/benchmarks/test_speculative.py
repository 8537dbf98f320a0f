"""`rl-engine bench rollout --case tail` (rl_engine/benchmarks/speculative.py) at `--tiny`: the
long-tailed step, the repetitive text and the arithmetic prompt, each without and with
speculation, with equal bits (the bench raises otherwise).

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import speculative
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number


def test_bench_rollout_tail(capsys):
    (rows,) = bench(capsys, "rollout", "--case", "tail")
    assert [r["case"] for r in rows] == ["tail", "repetitive", "arithmetic"]
    assert_figures(
        rows,
        times=("off s", "on s", "off s at batch <= 4", "on s at batch <= 4"),
        ratios=("on / off",),
    )
    assert all(r["bits"] == "equal" for r in rows)
    assert all(
        0 <= number(r["accept rate"]) <= 1 and number(r["tokens / forward"]) >= 1 for r in rows
    )


def test_the_case_runs_this_module():
    assert "speculative" in bench_modules("rollout", "tail")
    assert callable(speculative.main)
