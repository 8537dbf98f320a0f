"""`rl-engine bench kernels --case decode-gemm` (rl_engine/benchmarks/decode_gemm.py) at
`--tiny`: bf16 decode GEMM bandwidth rows at batch 1, 8 and 32.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import decode_gemm
from tests.helpers.bench_tables import assert_figures, bench, bench_modules


def test_bench_kernels_decode_gemm(capsys):
    (rows,) = bench(capsys, "kernels", "--case", "decode-gemm")
    assert [(r["dtype"], r["threads"], r["batch"]) for r in rows] == [
        ("bf16", "1", b) for b in ("1", "8", "32")
    ]
    assert_figures(rows, ratios=("gemm GB/s", "packed GB/s", "copy GB/s"))


def test_the_case_runs_this_module():
    assert "decode_gemm" in bench_modules("kernels", "decode-gemm")
    assert callable(decode_gemm.main)
