"""trainer.layout_invariant on real DeepSpeed ranks (gloo): runs that differ only in layout keys
(ranks, ZeRO stage, micro-batch size, packing, token budget) end every step with the same
weights and AdamW moments, bit for bit, and write the same metrics; a state saved on one
layout resumes on another and continues exactly. Negative control: the same layouts with the
flag off differ.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.worker.cell import cached_completions
from tests.helpers.worker.layout_runs import (
    BUDGET_TWO,
    PACKED_ONE,
    PADDED_TWO,
    SINGLES_FOUR,
    run_layout,
    same_metrics,
    same_state,
)


@pytest.mark.exhaustive  # make test: the same pair as a Ray job (tests/executors/job/test_layout_job.py)
def test_two_layouts_take_the_same_bf16_steps(tmp_path, completions):
    one = run_layout(tmp_path, completions, PACKED_ONE, "bfloat16")
    two = run_layout(tmp_path, completions, PADDED_TWO, "bfloat16")
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert int(one["state"]["step"]) == 3


def test_negative_control_the_plain_update_differs_between_layouts(tmp_path, completions):
    # one step: the plain update's sums already follow the layout in the first one
    one = run_layout(tmp_path, completions, PACKED_ONE, "bfloat16", invariant=False, steps=1)
    two = run_layout(tmp_path, completions, PADDED_TWO, "bfloat16", invariant=False, steps=1)
    assert same_state(one["state"], two["state"]) != []


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_four_layouts_take_the_same_steps(tmp_path, completions, dtype):
    runs = [
        run_layout(tmp_path, completions, layout, dtype)
        for layout in (PACKED_ONE, PADDED_TWO, SINGLES_FOUR, BUDGET_TWO)
    ]
    for run in runs[1:]:
        assert same_state(runs[0]["state"], run["state"]) == []
        assert same_metrics(runs[0]["metrics"], run["metrics"]) == []


@pytest.mark.exhaustive  # make test: 2 ZeRO-3 ranks -> 1 rank as a Ray job
@pytest.mark.parametrize(
    ("before", "after"),
    [(PADDED_TWO, PACKED_ONE), (PACKED_ONE, SINGLES_FOUR)],
    ids=["2to1", "1to4"],
)
def test_a_state_saved_on_one_layout_resumes_on_another(tmp_path, completions, before, after):
    whole = run_layout(tmp_path, completions, before, "bfloat16")
    saved = tmp_path / "after_one.pt"
    run_layout(tmp_path, completions, before, "bfloat16", steps=1, save=str(saved), save_after=1)
    resumed = run_layout(tmp_path, completions, after, "bfloat16", steps=2, resume=str(saved))
    assert same_state(whole["state"], resumed["state"]) == []


@pytest.mark.exhaustive
def test_a_state_saved_before_the_first_step_resumes_on_another_layout(tmp_path, completions):
    """Before its first step the optimizer holds no moments: the state holds AdamW's zeros."""
    whole = run_layout(tmp_path, completions, PACKED_ONE, "bfloat16", steps=2)
    saved = tmp_path / "before_any.pt"
    run_layout(
        tmp_path, completions, PADDED_TWO, "bfloat16", steps=0, save=str(saved), save_after=0
    )
    resumed = run_layout(tmp_path, completions, PACKED_ONE, "bfloat16", steps=2, resume=str(saved))
    assert int(torch.load(saved)["step"]) == 0
    assert same_state(whole["state"], resumed["state"]) == []
    assert same_metrics(whole["metrics"], resumed["metrics"]) == []


@pytest.mark.exhaustive
def test_a_moe_policy_takes_the_same_steps(tmp_path):
    path = tmp_path / "moe.pt"
    torch.save(cached_completions("float32", "tiny-qwen3-moe"), path)
    paths = {"float32": str(path)}
    one, two = (
        run_layout(tmp_path, paths, layout, "float32", model="tiny-qwen3-moe")
        for layout in (PACKED_ONE, PADDED_TWO)
    )
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert "router/max_load_share" in one["metrics"][0]


@pytest.mark.exhaustive
def test_mini_batches_and_epochs_take_the_same_steps(tmp_path, completions):
    split = {"mini_batch_size": 4, "epochs": 2}
    runs = [
        run_layout(tmp_path, completions, (world, stage, {**trainer, **split}), "bfloat16", steps=2)
        for world, stage, trainer in (PACKED_ONE, SINGLES_FOUR)
    ]
    assert same_state(runs[0]["state"], runs[1]["state"]) == []
    assert same_metrics(runs[0]["metrics"], runs[1]["metrics"]) == []
    assert runs[0]["metrics"][0]["updates"] == 4


@pytest.mark.exhaustive
def test_the_kl_penalty_keeps_the_steps_alike(tmp_path, completions):
    one, two = (
        run_layout(tmp_path, completions, layout, "bfloat16", kl_coef=0.05)
        for layout in (PACKED_ONE, PADDED_TWO)
    )
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert one["metrics"][-1]["kl"] > 0


@pytest.mark.exhaustive
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_every_loss_aggregation_keeps_the_steps_alike(tmp_path, completions, aggregation):
    algorithm = {"loss_aggregation": aggregation, "clip_eps_high": 0.28}
    one, two = (
        run_layout(tmp_path, completions, layout, "bfloat16", algorithm=algorithm)
        for layout in (PACKED_ONE, SINGLES_FOUR)
    )
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
