"""The native linear benchmark (rl_engine/benchmarks/native_linear.py) at `--tiny`: every tiny
shape in the dtypes the native backend's platform probe accepts here.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import native_linear
from rl_engine.kernels import kernel_facts
from tests.helpers.bench_tables import assert_figures, bench_modules, tables


def test_bench_kernels_native_linear(capsys):
    """Through the module: only the dtypes the native backend's platform probe accepts here
    (a refused dtype raises, as the op does)."""
    from rl_engine.benchmarks import native_linear

    facts = kernel_facts("cpu", "native")
    dtypes = [s for s in ("fp32", "bf16") if facts[f"native_{s}_platform"] == "invariant"]
    if not dtypes:
        pytest.skip(f"the native backend refuses fp32 and bf16 here: {facts}")
    (rows,) = tables(native_linear.main(["--tiny", "--dtypes", *dtypes]))
    assert {(r["case"], r["dtype"]) for r in rows} == {
        (case, dt) for case, *_ in native_linear.TINY_SHAPES for dt in dtypes
    }
    assert_figures(rows, times=("native ms", "F.linear ms"), ratios=("native / F.linear",))


def test_the_case_runs_this_module():
    assert "native_linear" in bench_modules("kernels", "native-linear")
    assert callable(native_linear.main)
