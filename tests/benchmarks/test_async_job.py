"""`rl-engine bench job --case async` (rl_engine/benchmarks/async_job.py) at `--tiny`: three
real tiny-llama jobs (k = 0, 1, 2), their table and the multi-node projection, every run
exact. Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import async_job
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number

# three jobs through the CLI, each starting its own Ray (30-70 s): the exhaustive tier
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.exhaustive]


def test_bench_job_async(capsys):
    measured, projected = bench(capsys, "job", "--case", "async")
    assert [r["k"] for r in measured] == ["0", "1", "2"]
    assert_figures(
        measured, times=("step s (median)", "best s", "generate s", "train s"), ratios=("vs k = 0",)
    )
    assert [number(r["max staleness"]) for r in measured] == [0, 1, 2]
    assert all(number(r["parity exact"]) == 1.0 for r in measured)
    assert len(projected) == 3 and all(number(r["step s"]) > 0 for r in projected)


def test_the_case_runs_this_module():
    assert "async_job" in bench_modules("job", "async")
    assert callable(async_job.main)
