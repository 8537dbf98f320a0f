"""`rl-engine bench kernels` (rl_engine/benchmarks/kernels.py) at `--tiny`: a row per op, dtype
and shape with both timings and their ratio, and linear_logp's fused vs materialised memory.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import kernels
from rl_engine.kernels import OP_NAMES
from tests.helpers.bench_tables import DTYPES, assert_figures, bench, bench_modules


@pytest.mark.multiprocess  # the linear_logp memory probes: one fresh process each
def test_bench_kernels(capsys):
    timings, memory = bench(capsys, "kernels")
    ops = {"linear", "rms_norm", "silu", "log_softmax", "attention", "linear_logp"}
    assert ops <= set(OP_NAMES)
    assert {(r["op"], r["dtype"]) for r in timings} == {(op, dt) for op in ops for dt in DTYPES}
    assert len(timings) == 2 * 11  # a training and a decode shape per op (log_softmax: decode)
    plain = "batch_invariant=false (plain torch) ms"
    assert_figures(timings, times=("batch_invariant=true ms", plain), ratios=("ratio",))
    assert [r["linear_logp peak extra memory"] for r in memory] == ["24 tok x 300 vocab, float32"]
    assert_figures(memory, memory=("fused MiB", "materialised MiB"))


def test_the_case_runs_this_module():
    assert "kernels" in bench_modules("kernels", None)
    assert callable(kernels.main)
