"""The layout-free update's multi-rank runs (tests/helpers/worker/layout_free_job.py on real
DeepSpeed ranks), shared by layout_free/test_update.py and layout_free/test_state.py."""

from __future__ import annotations

import torch

from tests.helpers.worker.launch import run_ranks, run_worlds

JOB = "tests.helpers.worker.layout_free_job"


def run_layout_free(tmp_path, world, stage, dtype, optimizer="invariant", **extra) -> dict:
    """Rank 0's result of `steps` (default 2) steps on `world` ranks at ZeRO `stage`."""
    out = tmp_path / f"w{world}_z{stage}_{dtype}_{optimizer}_{extra.get('first_step', 0)}"
    spec = {"job": JOB, "stage": stage, "dtype": dtype, "optimizer": optimizer, **extra}
    results, error = run_ranks({"steps": 2, **spec}, world, out)
    assert error is None, error
    return results[0]["layout_free_job"]


def run_layout_frees(out_dir, runs: dict) -> dict:
    """Rank 0's result of each named run ({name: (world, stage, dtype, optimizer)}, 2 steps);
    the runs of one world size share one request (`run_worlds`)."""
    specs = {
        name: (world, {"steps": 2, "stage": stage, "dtype": dtype, "optimizer": optimizer})
        for name, (world, stage, dtype, optimizer) in runs.items()
    }
    return run_worlds(JOB, specs, out_dir)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
