"""LoRA policies on the worker with real DeepSpeed: the trainer's logprobs == the engine's, bitwise.

The RolloutEngine serves the PEFT-wrapped, patched, unmerged policy (A and B perturbed: B != 0)
and samples a step; the DeepSpeed worker's logprobs of it must be torch.equal to the sampled
ones, and its strict step must pass. The step trains only the adapters: base weights
unchanged, optimizer state the adapters' size. Negative controls: an engine that merges the
adapter into W, and plain PEFT (torch's linear for A and B) in the trainer, both differ.
`make test` keeps one cell per axis (dtype, MoE, packed / padded, ZeRO-3 on 2 ranks); the
rest is `exhaustive`.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from rl_engine.config import LoraConfig
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.patching import apply_batch_invariant
from tests.helpers.lora_policy import merge_adapters, unpatch_adapters
from tests.helpers.parity.lora_cells import (
    cell_key,
    lora_cell_config,
    lora_completions,
    lora_engine,
    lora_policy,
    run_lora_cell,
)
from tests.helpers.worker.cell import generate, to_batch
from tests.helpers.worker.launch import run_ranks

ONE_RANK = [
    (0, "float32", "tiny-llama", True),
    (0, "bfloat16", "tiny-qwen3", False),
    (0, "float32", "tiny-qwen2-moe", True),
    *(
        pytest.param(*cell, marks=pytest.mark.exhaustive)
        for cell in (
            (0, "float32", "tiny-llama", False),
            (1, "bfloat16", "tiny-qwen3", True),
            (2, "float32", "tiny-qwen2", True),
            (3, "bfloat16", "tiny-mistral", False),
            (3, "float32", "tiny-qwen3-moe", True),
            (0, "bfloat16", "tiny-qwen2-moe", False),
        )
    ),
]
TWO_RANKS = [(3, "float32", "tiny-llama", False), (3, "bfloat16", "tiny-qwen3", True)]


def check_lora_cell(r: dict) -> None:
    mask = r["mask"]
    assert mask.any()
    assert torch.equal(r["lp0"][mask], r["rollout_lp"][mask]), "trainer != engine with LoRA"
    assert r["metrics"]["parity/exact_match_fraction"] == 1.0
    assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
    assert r["optimizer_numel"] > 0


def check_only_adapters_trained(r: dict) -> None:
    """Rank 0 (it holds the exported weights): the step moved adapters and nothing else, and
    a resume from the checkpoint retook the next step bitwise."""
    assert r["changed"] and set(r["changed"]) <= set(r["adapters"])
    assert r["adapter_numel"] < 0.1 * r["model_numel"]
    assert r["resume_diff"] == []


@pytest.mark.parametrize(("stage", "dtype", "model", "packing"), ONE_RANK)
def test_one_rank_lora_parity_and_only_the_adapters_train(stage, dtype, model, packing, tmp_path):
    config = lora_cell_config(stage, 1, dtype, model, packing)
    r = run_lora_cell(config, lora_completions(config), workdir=tmp_path)
    check_lora_cell(r)
    check_only_adapters_trained(r)
    assert r["optimizer_numel"] == r["adapter_numel"]  # no state for the frozen base


def _two_rank_cells(cells, tmp_path: Path) -> None:
    files = {}
    for cell in cells:
        config = lora_cell_config(cell[0], 2, *cell[1:])
        files[cell_key(*cell)] = str(tmp_path / f"{cell_key(*cell)}.pt")
        torch.save(lora_completions(config), files[cell_key(*cell)])
    spec = {"job": "tests.helpers.parity.lora_cells", "cells": cells, "completions": files}
    ranks, error = run_ranks(spec, 2, Path(tmp_path) / "world2", timeout=420)
    assert error is None, error
    for cell in cells:
        results = [r["lora_cells"][cell_key(*cell)] for r in ranks]
        for r in results:
            check_lora_cell(r)
        check_only_adapters_trained(results[0])
        assert 0 < sum(r["optimizer_numel"] for r in results) <= results[0]["adapter_numel"] + 64
        assert results[0]["metrics"] == results[1]["metrics"]


def test_two_ranks_zero3_lora_parity(tmp_path):
    _two_rank_cells(TWO_RANKS, tmp_path)


@pytest.mark.exhaustive
def test_two_ranks_zero1_zero2_lora_parity(tmp_path):
    _two_rank_cells(
        [(1, "float32", "tiny-qwen2", True), (2, "bfloat16", "tiny-llama", False)], tmp_path
    )


def test_an_engine_that_merges_the_adapter_differs():
    config = lora_cell_config(0, 1, "float32", "tiny-llama", True)
    merged = lora_policy(config)
    merge_adapters(merged)
    completions = generate(lora_engine(merged), config, seed=5)
    shard = to_batch(completions).shard(0, 1)
    worker = DeepSpeedTrainingWorker(config, device="cpu", model=lora_policy(config))
    mask = shard.response_mask
    assert not torch.equal(worker.compute_logprobs(shard)[mask], shard.rollout_logprobs[mask])


def test_plain_peft_in_the_trainer_differs():
    """A wide adapter (rank 1024: B's reduction is 1024 terms long): at short reductions torch's
    GEMM can happen to sum in the fixed order (at rank 8 it did on an AVX-512 Xeon)."""
    config = lora_cell_config(0, 1, "float32", "tiny-llama", True)
    config = dataclasses.replace(
        config, lora=dataclasses.replace(config.lora, rank=1024, alpha=2048)
    )
    policy = lora_policy(config)
    completions = generate(lora_engine(copy.deepcopy(policy)), config, seed=5)
    apply_batch_invariant(policy)
    unpatch_adapters(policy)  # the worker keeps a patched model as it is
    worker = DeepSpeedTrainingWorker(config, device="cpu", model=policy)
    shard = to_batch(completions).shard(0, 1)
    mask = shard.response_mask
    assert not torch.equal(worker.compute_logprobs(shard)[mask], shard.rollout_logprobs[mask])


def test_resuming_adapters_on_another_base_is_refused_before_loading(tmp_path):
    config = lora_cell_config(0, 1, "float32", "tiny-llama", True)
    worker = DeepSpeedTrainingWorker(config, device="cpu", model=lora_policy(config))
    worker.save_checkpoint(tmp_path / "ckpt")
    other_base = dataclasses.replace(config, seed=config.seed + 1)  # a tiny model's weights
    other = DeepSpeedTrainingWorker(other_base, device="cpu")
    with pytest.raises(
        ValueError, match=r"lora: checkpoint .* holds adapters of base 'tiny-llama'"
    ):
        other.load_checkpoint(tmp_path / "ckpt")
    full = DeepSpeedTrainingWorker(dataclasses.replace(config, lora=LoraConfig()), device="cpu")
    with pytest.raises(ValueError, match="holds LoRA adapters .* this run has lora.rank 0"):
        full.load_checkpoint(tmp_path / "ckpt")
