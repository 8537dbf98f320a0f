"""`rl-engine bench train --case packing` (rl_engine/benchmarks/packing.py) at `--tiny`: the
padded and packed train steps, their parity exact (rollout logprobs == the trainer's).

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks import packing
from tests.helpers.bench_tables import assert_figures, bench, bench_modules, number


@pytest.mark.multiprocess  # one DeepSpeed worker process per layout
@pytest.mark.slow
def test_bench_train_packing(capsys):
    (rows,) = bench(capsys, "train", "--case", "packing")
    padded, packed, ratio = rows
    assert padded["layout"].startswith("padded") and packed["layout"].startswith("packed")
    assert_figures([padded, packed], times=("step s",), memory=("peak extra MiB",))
    assert padded["parity"] == packed["parity"] == "1.0000"  # rollout logprobs == trainer's
    assert number(ratio["step s"]) > 0


def test_the_case_runs_this_module():
    assert "packing" in bench_modules("train", "packing")
    assert callable(packing.main)
