"""`rl-engine bench kernels --case gemm` (rl_engine/benchmarks/gemm.py) at `--tiny`: every tiny
shape in both dtypes, the lm_head and linear paths against F.linear.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import gemm
from tests.helpers.bench_tables import assert_figures, bench, bench_modules


def test_bench_kernels_gemm(capsys):
    (rows,) = bench(capsys, "kernels", "--case", "gemm")
    from rl_engine.benchmarks.gemm import TINY_SHAPES

    expected = {(name, dt) for name, *_ in TINY_SHAPES for dt in ("fp32", "bf16")}
    assert {(r["shape"], r["dtype"]) for r in rows} == expected
    times = ("lm_head ms", "linear ms", "F.linear ms")
    assert_figures(rows, times=times, ratios=("lm_head / F", "linear / F"))


def test_the_case_runs_this_module():
    assert "gemm" in bench_modules("kernels", "gemm")
    assert callable(gemm.main)
