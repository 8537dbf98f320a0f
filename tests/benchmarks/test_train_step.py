"""`rl-engine bench train --case invariance` (rl_engine/benchmarks/train_step.py) at `--tiny`:
the invariant and plain training step's time and peak memory, and the logprob memory rows.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import train_step
from tests.helpers.bench_tables import assert_figures, bench, bench_modules


@pytest.mark.multiprocess  # the invariant and plain workers and the memory probes: processes
@pytest.mark.slow
def test_bench_train_invariance(capsys):
    steps, memory = bench(capsys, "train", "--case", "invariance")
    assert [(r["dtype"], r["ZeRO"]) for r in steps] == [("float32", "ZeRO-0")]
    assert_figures(
        steps,
        times=("step s (batch_invariant=true)", "step s (batch_invariant=false)"),
        ratios=("ratio",),
        memory=("peak extra MiB (true)", "peak extra MiB (false)"),
    )
    assert_figures(memory, memory=("fused MiB", "materialised MiB"))


def test_the_case_runs_this_module():
    assert "train_step" in bench_modules("train", "invariance")
    assert callable(train_step.main)
