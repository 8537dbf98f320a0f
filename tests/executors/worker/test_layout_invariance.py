"""trainer.layout_invariant on real DeepSpeed ranks (gloo): runs that differ only in layout keys
(ranks, ZeRO stage, micro-batch size, packing, token budget) end every step with the same
weights and AdamW moments, bit for bit, and write the same metrics; a state saved on one
layout resumes on another and continues exactly. Negative control: the same layouts with the
flag off differ. The selected tests' runs share one request per world size to the pytest
process's world (`runs`, world_server.py); a run that shares a world takes the bits of its own
launch (the last test; across modules: test_world_server.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.worker.cell import cached_completions
from tests.helpers.worker.launch import selected_runs
from tests.helpers.worker.layout_runs import (
    BUDGET_TWO,
    PACKED_ONE,
    PADDED_TWO,
    SINGLES_FOUR,
    layout_pair,
    run_layout,
    run_layouts,
    same_metrics,
    same_state,
)

FOUR = {"one": PACKED_ONE, "two": PADDED_TWO, "four": SINGLES_FOUR, "budget": BUDGET_TWO}
SPLIT = {"mini_batch_size": 4, "epochs": 2}
AGGREGATIONS = ["seq-mean-token-mean", "seq-mean-token-sum"]
PLAIN = layout_pair("plain", invariant=False, steps=1)  # one step: the sums already differ


def _with(layout, **trainer):
    world, stage, keys = layout
    return world, stage, {**keys, **trainer}


# each test's runs ({name: (layout, dtype, kwargs)}); a name names one spec in every test
RUNS = {
    "test_two_layouts_take_the_same_bf16_steps": layout_pair("bfloat16"),
    "test_negative_control_the_plain_update_differs_between_layouts": PLAIN,
    **{
        f"test_four_layouts_take_the_same_steps[{dtype}]": {
            f"{dtype}/{name}": (layout, dtype, {}) for name, layout in FOUR.items()
        }
        for dtype in ("float32", "bfloat16")
    },
    "test_mini_batches_and_epochs_take_the_same_steps": {
        "split/one": (_with(PACKED_ONE, **SPLIT), "bfloat16", {"steps": 2}),
        "split/four": (_with(SINGLES_FOUR, **SPLIT), "bfloat16", {"steps": 2}),
    },
    "test_the_kl_penalty_keeps_the_steps_alike": layout_pair("kl", kl_coef=0.05),
    **{
        f"test_every_loss_aggregation_keeps_the_steps_alike[{aggregation}]": {
            f"{aggregation}/{name}": (
                layout,
                "bfloat16",
                {"algorithm": {"loss_aggregation": aggregation, "clip_eps_high": 0.28}},
            )
            for name, layout in (("one", PACKED_ONE), ("four", SINGLES_FOUR))
        }
        for aggregation in AGGREGATIONS
    },
    # after the invariant pair in each world: what it shares a process with must not leak
    "test_a_run_that_shares_a_world_takes_the_bits_of_its_own_launch": {
        **layout_pair("bfloat16"),
        **PLAIN,
    },
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, completions) -> dict:
    out_dir = tmp_path_factory.mktemp("layouts")
    return run_layouts(out_dir, completions, selected_runs(request, RUNS))


@pytest.mark.exhaustive  # make test: the same pair as a Ray job (tests/executors/job/test_layout_job.py)
def test_two_layouts_take_the_same_bf16_steps(runs):
    one, two = runs["bfloat16/one"], runs["bfloat16/two"]
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert int(one["state"]["step"]) == 3


def test_negative_control_the_plain_update_differs_between_layouts(runs):
    # one step: the plain update's sums already follow the layout in the first one
    one, two = runs["plain/one"], runs["plain/two"]
    assert same_state(one["state"], two["state"]) != []


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_four_layouts_take_the_same_steps(runs, dtype):
    first, *others = (runs[f"{dtype}/{name}"] for name in FOUR)
    for run in others:
        assert same_state(first["state"], run["state"]) == []
        assert same_metrics(first["metrics"], run["metrics"]) == []


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
def test_mini_batches_and_epochs_take_the_same_steps(runs):
    one, four = runs["split/one"], runs["split/four"]
    assert same_state(one["state"], four["state"]) == []
    assert same_metrics(one["metrics"], four["metrics"]) == []
    assert one["metrics"][0]["updates"] == 4


@pytest.mark.exhaustive
def test_the_kl_penalty_keeps_the_steps_alike(runs):
    one, two = runs["kl/one"], runs["kl/two"]
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert one["metrics"][-1]["kl"] > 0


@pytest.mark.exhaustive
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_loss_aggregation_keeps_the_steps_alike(runs, aggregation):
    one, four = runs[f"{aggregation}/one"], runs[f"{aggregation}/four"]
    assert same_state(one["state"], four["state"]) == []
    assert same_metrics(one["metrics"], four["metrics"]) == []


@pytest.mark.exhaustive
def test_a_run_that_shares_a_world_takes_the_bits_of_its_own_launch(runs, tmp_path, completions):
    """The plain runs follow the invariant pair in their worlds' processes (fresh engine,
    model and seed; the process group reused), and end where their own launches end."""
    for name, (layout, dtype, kwargs) in PLAIN.items():
        alone = run_layout(tmp_path, completions, layout, dtype, fresh=True, **kwargs)
        assert same_state(runs[name]["state"], alone["state"]) == []
        assert same_metrics(runs[name]["metrics"], alone["metrics"]) == []
