"""`rl-engine bench rollout --case tp` (rl_engine/benchmarks/tensor_parallel.py) at `--tiny`:
TP = 2 samples the TP = 1 tokens (the benchmark raises otherwise), and the bytes a rank sent
per decode token and layer are the design's formula.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import tensor_parallel
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number


@pytest.mark.multiprocess  # TP = 2 ranks and the TP = 1 references, each in new processes
@pytest.mark.slow
def test_bench_rollout_tensor_parallel(capsys):
    """TP = 2 samples the TP = 1 tokens (the benchmark raises otherwise), and the bytes a rank
    sent per decode token and layer are the design's formula."""
    measured, formula = bench(capsys, "rollout", "--case", "tp")
    (row,) = measured
    assert row["dtype"] == "float32"
    assert_figures(
        measured,
        times=("prefill TP=1 2 threads ms", "decode step TP=2 ms"),
        ratios=("TP2 / TP1 2 threads",),
    )
    sent = row["bytes sent / token / layer / rank (measured)"]
    assert number(sent) == number(formula[0]["this design, formula (bytes / token / layer / rank)"])


def test_the_case_runs_this_module():
    assert "tensor_parallel" in bench_modules("rollout", "tp")
    assert callable(tensor_parallel.main)
