"""`rl-engine bench kernels --case attention` (rl_engine/benchmarks/attention_cpp.py) at
`--tiny`: every tiny case in both dtypes, the cpp kernel against SDPA.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import attention_cpp
from tests.helpers.bench_tables import DTYPES, assert_figures, bench, bench_modules


def test_bench_kernels_attention(capsys):
    (rows,) = bench(capsys, "kernels", "--case", "attention")
    from rl_engine.benchmarks.attention_cpp import TINY_CASES

    expected = {(name, dt) for name, _ in TINY_CASES for dt in DTYPES}
    assert {(r["case"], r["dtype"]) for r in rows} == expected
    assert_figures(rows, times=("cpp ms", "SDPA ms"), ratios=("ratio",))


def test_the_case_runs_this_module():
    assert "attention_cpp" in bench_modules("kernels", "attention")
    assert callable(attention_cpp.main)
