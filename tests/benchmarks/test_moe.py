"""`rl-engine bench moe` (rl_engine/benchmarks/moe.py) at `--tiny`: the invariant experts
against grouped_mm and the eager loop in both dtypes, and their peak memory.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import moe
from tests.helpers.bench_tables import DTYPES, assert_figures, bench, bench_modules


@pytest.mark.multiprocess  # the peak-memory probes: one fresh process each
def test_bench_moe(capsys):
    timings, memory = bench(capsys, "moe")
    assert {r["dtype"] for r in timings} == DTYPES and len(timings) == 6
    times = ("batch_invariant=true ms", "plain grouped_mm ms", "plain eager ms")
    assert_figures(timings, times=times, ratios=("ratio vs grouped_mm",))
    assert [r["experts"] for r in memory] == ["8"]
    assert_figures(memory, memory=("invariant MiB", "grouped_mm MiB"))


def test_the_case_runs_this_module():
    assert "moe" in bench_modules("moe", None)
    assert callable(moe.main)
