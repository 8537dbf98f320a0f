"""The worker on real DeepSpeed with mixture-of-experts policies: ZeRO 0/1/2/3 x 1/2 ranks x fp32/bf16.

Each cell is tests/helpers/worker/cell.py's (strict parity with the RolloutEngine
before the step, loss decreasing, KL, exported weights reproducing the
worker's logprobs on NEW rollouts, resume == uninterrupted, a nudged logprob
raising on every rank), on Qwen3-MoE (fp32: a dense middle layer, expert width
44) and Qwen2-MoE (bf16: shared expert behind a sigmoid gate, width 36), with
the router's auxiliary loss on. ZeRO-3 partitions the 3-D expert weights: the
patched experts must see them gathered in forward, backward and export.
`make test` runs the 1-rank ZeRO-0 fp32 cell and the 2-rank ZeRO-3 fp32 cell;
the rest is slow-marked.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from rl_engine.executors.deepspeed_trainer import DeepSpeedTrainingWorker
from tests.helpers.worker.cell import cached_completions, cell_config, cell_name
from tests.helpers.worker.launch import run_ranks
from tests.helpers.parity.moe_cells import AUX, MODELS, run_moe_cell
from tests.parity.test_worker_matrix import check_cell

STAGES = (0, 1, 2, 3)
DTYPES = ("float32", "bfloat16")
QUICK_ONE_RANK = {(0, "float32")}
QUICK_TWO_RANKS = {(3, "float32")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("worker_moe"))


@functools.cache
def _one_rank(stage: int, dtype: str, root: str) -> dict:
    completions = cached_completions(dtype, MODELS[dtype])
    return run_moe_cell(stage, 1, dtype, completions, Path(root) / cell_name(stage, 1, dtype))


@functools.cache
def _two_ranks(cells: tuple, root: str):
    files = {}
    for dtype in {d for _, d in cells}:
        files[dtype] = str(Path(root) / f"completions-{dtype}.pt")
        torch.save(cached_completions(dtype, MODELS[dtype]), files[dtype])
    spec = {
        "job": "tests.helpers.parity.moe_cells",
        "cells": [list(c) for c in cells],
        "completions": files,
    }
    name = "-".join(f"{s}{d[0]}" for s, d in cells)
    ranks, error = run_ranks(spec, 2, Path(root) / f"world2-{name}", timeout=900)
    return [r.get("moe_cells", {}) for r in ranks], error


def _check_moe(results: list[dict], stage: int, dtype: str) -> None:
    check_cell(results, stage, dtype)
    config = cell_config(stage, len(results), dtype, MODELS[dtype], algorithm=AUX)
    experts = {"tiny-qwen3-moe": 8, "tiny-qwen2-moe": 6}[config.model]
    for r in results:
        for m in r["metrics"]:
            assert math.isfinite(m["router/aux_loss"]) and m["router/aux_loss"] > 0, m
            assert (
                1 / experts <= m["router/max_load_share"] <= m["router/max_load_share_worst_layer"]
            )
            assert 0 < m["router/load_entropy"] <= math.log(experts) + 1e-9
        if stage == 3:
            assert r["expert_numel_outside_forward"], "no expert weights found"
            assert all(n == 0 for n in r["expert_numel_outside_forward"]), (
                "ZeRO-3 should partition the 3-D expert weights"
            )


def _cells(quick: set):
    for dtype in DTYPES:
        for stage in STAGES:
            marks = [] if (stage, dtype) in quick else [pytest.mark.slow, pytest.mark.exhaustive]
            yield pytest.param(stage, dtype, marks=marks, id=f"zero{stage}-{dtype}")


@pytest.mark.parametrize(("stage", "dtype"), list(_cells(QUICK_ONE_RANK)))
def test_one_rank_moe_cell(stage, dtype, workdir):
    _check_moe([_one_rank(stage, dtype, workdir)], stage, dtype)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "dtype"), list(_cells(QUICK_TWO_RANKS)))
def test_two_rank_moe_cell(stage, dtype, workdir):
    """The quick cell runs alone; the slow ones share one 2-rank job of the whole matrix."""
    quick = (stage, dtype) in QUICK_TWO_RANKS
    cells = ((stage, dtype),) if quick else tuple((s, d) for d in DTYPES for s in STAGES)
    ranks, error = _two_ranks(cells, workdir)
    name = cell_name(stage, 2, dtype)
    if not all(name in r for r in ranks):
        pytest.fail(f"2-rank MoE cell {name} has no result: {error}")
    results = [r[name] for r in ranks]
    _check_moe(results, stage, dtype)
    last, first = results[-1]["strict_error"], results[0]["strict_error"]
    assert last is not None and first is not None, "strict parity did not raise on every rank"
    assert last["step_unchanged"] and first["step_unchanged"]


def test_aux_loss_on_a_dense_model_is_refused():
    config = cell_config(0, 1, "float32", "tiny-llama", algorithm={"router_aux_loss_coef": 0.1})
    with pytest.raises(ValueError, match="router_aux_loss_coef is 0.1 but model 'tiny-llama'"):
        DeepSpeedTrainingWorker(config, device="cpu")
