"""Bad batches on 2 real DeepSpeed ranks (gloo): the last rank holds the bad data.

Each case must end in a BatchError on EVERY rank within 30 s (no rank waits in a
collective), naming the bad rank and why, with weights and optimizer state
unchanged; afterwards the worker still exports and takes a good step. Also: an
exception mid-forward under ZeRO-3 leaves the worker usable, and a non-finite
loss on one rank skips the update on all ranks (ZeRO-3, where DeepSpeed skips by
itself, and ZeRO-0, where only the worker's StepGuard does).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.worker.bad_batches import CASES
from tests.helpers.worker.cell import cached_completions
from tests.helpers.worker.launch import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.deadline]  # every rank errs within 30 s
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    workdir = Path(tmp_path_factory.mktemp("bad_batches"))
    completions = workdir / "completions-float32.pt"
    torch.save(cached_completions("float32"), completions)
    spec = {
        "job": "tests.helpers.worker.bad_batches",
        "completions": {"float32": str(completions)},
    }
    results, error = run_ranks(spec, WORLD, workdir / "world2", timeout=240)
    if error is not None or not all("bad_batches" in r for r in results):
        pytest.fail(f"the 2-rank bad-batch session failed: {error}")
    return [r["bad_batches"] for r in results]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_batch_is_a_batch_error_on_every_rank(ranks, case):
    pattern = CASES[case][1]
    for rank, result in enumerate(ranks):
        outcome = result["cases"][case]
        assert outcome["error"] == "BatchError", (rank, outcome)
        assert outcome["seconds"] < 30, (rank, outcome)
        assert outcome["ranks"] == (WORLD - 1,), (rank, outcome)
        assert re.search(pattern, outcome["message"]), (rank, outcome["message"])
        if case != "other_temperature":
            assert f"bad batch on rank(s) {WORLD - 1}; no forward was run" in outcome["message"]


def test_weights_and_optimizer_unchanged_by_bad_batches(ranks):
    assert all(r["unchanged_after_bad"] for r in ranks)


def test_exception_mid_forward_leaves_zero3_worker_usable(ranks):
    for result in ranks:
        assert result["mid_forward"]["error"] == "RuntimeError", result["mid_forward"]
        assert "injected failure mid-forward" in result["mid_forward"]["message"]
        assert result["unchanged_after_mid_forward"]
        good = result["good_step"]  # the next step works, on-policy and strict
        assert good["skipped_update"] == 0 and good["weight_version"] == 1
        assert good["parity/exact_match_fraction"] == 1.0 and math.isfinite(good["loss"])


@pytest.mark.parametrize("stage", ["zero3", "zero0"])
def test_non_finite_loss_on_one_rank_skips_the_update_on_all(ranks, stage):
    for result in ranks:
        skip = result[f"skip_{stage}"]
        m = skip["metrics"]
        assert m["skipped_update"] == 1 and m["skip_reason"] == "non-finite loss", m
        assert not math.isfinite(m["loss"])
        assert (
            skip["weights_unchanged"] and skip["optimizer_unchanged"] and skip["version_unchanged"]
        )
        nxt = skip["next"]
        assert nxt["skipped_update"] == 0 and math.isfinite(nxt["loss"]), nxt
        assert nxt["weight_version"] == m["weight_version"] + 1
    first, second = (r[f"skip_{stage}"]["metrics"] for r in ranks)
    assert first.keys() == second.keys()
    for key, value in first.items():  # the same on every rank (nan == nan here)
        assert value == second[key] or (value != value and second[key] != second[key]), key
