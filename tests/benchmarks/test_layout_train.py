"""`rl-engine bench train --case layout` (rl_engine/benchmarks/layout_train.py) at `--tiny`:
the plain and layout-invariant updates on two ranks, and the invariant update's parts.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import layout_train
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number


@pytest.mark.exhaustive  # ~60 s; make test runs the mode itself (tests/executors/job/test_layout_job.py)
@pytest.mark.multiprocess  # 2 configurations x 2 gloo DeepSpeed ranks, one process each
@pytest.mark.slow
def test_bench_train_layout(capsys):
    steps, parts = bench(capsys, "train", "--case", "layout")
    assert [(r["dtype"], r["update"]) for r in steps] == [
        ("float32", "plain"),
        ("float32", "layout_invariant"),
    ]
    peaks = ("peak RSS rank 0", "peak RSS rank 1", "peak RSS sum", "peak extra sum")
    assert_figures(steps, times=("step s",), memory=peaks)
    assert_figures(steps[1:], ratios=("time ratio", "memory ratio"))
    assert [r["dtype"] for r in parts] == ["float32"]
    from rl_engine.executors.worker.layout_free.update import PARTS

    assert_figures(parts, times=("step s", *PARTS))
    assert number(parts[0]["sink tensors at the end"]) >= 1
    assert number(parts[0]["sink peak tensors (bound)"]) >= number(
        parts[0]["sink tensors at the end"]
    )


def test_the_case_runs_this_module():
    assert "layout_train" in bench_modules("train", "layout")
    assert callable(layout_train.main)
