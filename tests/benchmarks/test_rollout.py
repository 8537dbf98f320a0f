"""`rl-engine bench rollout` (rl_engine/benchmarks/rollout.py) at `--tiny`: the decode rows
with the roofline beside them, and the GRPO-shaped case (sharing the prefill changes no token
or logprob; fewer prefill tokens with it).

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

from rl_engine.benchmarks import rollout
from tests.helpers.bench_tables import DTYPES, assert_figures, bench, bench_modules, number


def test_bench_rollout_decode(capsys):
    """The decode rows with the roofline beside them, and the GRPO-shaped case (the benchmark
    raises if sharing the prefill changed a token or a logprob)."""
    rows, grpo = bench(capsys, "rollout")
    assert {r["dtype"] for r in rows} == DTYPES
    rates = ("(a) invariant tok/s", "(b) off tok/s", "(c) HF tok/s")
    assert_figures(rows, ratios=(*rates, "(a)/(c)", "(a)/(c) with prefill"))
    roofline = ("MB / step", "copy GB/s", "GFLOP / step", "GEMM GFLOP/s")
    limits = ("bytes limit tok/s", "FLOP limit tok/s")
    fractions = ("(a) / limit", "(a) / bytes limit", "(c) / limit")
    assert_figures(rows, ratios=(*roofline, *limits, *fractions))
    assert {r["bound"] for r in rows} <= {"memory", "compute"}
    (row,) = grpo
    assert row["tokens and logprobs"] == "equal"
    on, off = "whole call s, sharing on", "whole call s, off"
    first = ("1-token call s, on", "1-token call s, off")
    assert_figures(grpo, times=(on, off, *first), ratios=("off / on", "shared prefills"))
    assert number(row["prefill tokens on"]) < number(row["prefill tokens off"])


def test_the_case_runs_this_module():
    assert "rollout" in bench_modules("rollout", None)
    assert callable(rollout.main)
