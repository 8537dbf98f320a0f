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
from tests.helpers.worker.launch import run_ranks

JOB = "tests.helpers.worker.layout_job"
# (ranks, ZeRO stage, trainer keys)
PACKED_ONE = (1, 0, {"micro_batch_size": 8, "packing": True})
PADDED_TWO = (2, 3, {"micro_batch_size": 2, "packing": False})
SINGLES_FOUR = (4, 1, {"micro_batch_size": 1})
BUDGET_TWO = (2, 2, {"micro_batch_size": 4, "max_tokens_per_micro_batch": 40})
LAYOUT_KEYS = {"time/"}  # metric keys allowed to differ: timings only


def _run(tmp_path, completions, layout, dtype, *, invariant=True, steps=3, tag="", **extra):
    world, stage, trainer = layout
    out = tmp_path / f"w{world}_z{stage}_{dtype}_{invariant}_{tag}_{len(list(tmp_path.iterdir()))}"
    spec = {
        "job": JOB,
        "stage": stage,
        "dtype": dtype,
        "steps": steps,
        "completions": completions[dtype],
        "trainer": {**trainer, "layout_invariant": invariant},
        **extra,
    }
    results, error = run_ranks(spec, world, out, timeout=600)
    assert error is None, error
    return results[0]["layout_job"]


def _same_state(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def _same_metrics(a: list[dict], b: list[dict]) -> list[str]:
    differ = []
    for step, (row_a, row_b) in enumerate(zip(a, b, strict=True)):
        for key in sorted(row_a.keys() | row_b.keys()):
            if any(key.startswith(prefix) for prefix in LAYOUT_KEYS):
                continue
            if row_a.get(key) != row_b.get(key):
                differ.append(f"step {step + 1} {key}: {row_a.get(key)} vs {row_b.get(key)}")
    return differ


@pytest.mark.exhaustive  # make test: the same pair as a Ray job (tests/executors/job/test_layout_job.py)
def test_two_layouts_take_the_same_bf16_steps(tmp_path, completions):
    one = _run(tmp_path, completions, PACKED_ONE, "bfloat16")
    two = _run(tmp_path, completions, PADDED_TWO, "bfloat16")
    assert _same_state(one["state"], two["state"]) == []
    assert _same_metrics(one["metrics"], two["metrics"]) == []
    assert int(one["state"]["step"]) == 3


def test_negative_control_the_plain_update_differs_between_layouts(tmp_path, completions):
    one = _run(tmp_path, completions, PACKED_ONE, "bfloat16", invariant=False)
    two = _run(tmp_path, completions, PADDED_TWO, "bfloat16", invariant=False)
    assert _same_state(one["state"], two["state"]) != []


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_four_layouts_take_the_same_steps(tmp_path, completions, dtype):
    runs = [
        _run(tmp_path, completions, layout, dtype)
        for layout in (PACKED_ONE, PADDED_TWO, SINGLES_FOUR, BUDGET_TWO)
    ]
    for run in runs[1:]:
        assert _same_state(runs[0]["state"], run["state"]) == []
        assert _same_metrics(runs[0]["metrics"], run["metrics"]) == []


@pytest.mark.exhaustive  # make test: 2 ZeRO-3 ranks -> 1 rank as a Ray job
@pytest.mark.parametrize(
    ("before", "after"),
    [(PADDED_TWO, PACKED_ONE), (PACKED_ONE, SINGLES_FOUR)],
    ids=["2to1", "1to4"],
)
def test_a_state_saved_on_one_layout_resumes_on_another(tmp_path, completions, before, after):
    whole = _run(tmp_path, completions, before, "bfloat16")
    saved = tmp_path / "after_one.pt"
    _run(tmp_path, completions, before, "bfloat16", steps=1, save=str(saved), save_after=1)
    resumed = _run(tmp_path, completions, after, "bfloat16", steps=2, resume=str(saved))
    assert _same_state(whole["state"], resumed["state"]) == []


@pytest.mark.exhaustive
def test_a_state_saved_before_the_first_step_resumes_on_another_layout(tmp_path, completions):
    """Before its first step the optimizer holds no moments: the state holds AdamW's zeros."""
    whole = _run(tmp_path, completions, PACKED_ONE, "bfloat16", steps=2)
    saved = tmp_path / "before_any.pt"
    _run(tmp_path, completions, PADDED_TWO, "bfloat16", steps=0, save=str(saved), save_after=0)
    resumed = _run(tmp_path, completions, PACKED_ONE, "bfloat16", steps=2, resume=str(saved))
    assert int(torch.load(saved)["step"]) == 0
    assert _same_state(whole["state"], resumed["state"]) == []
    assert _same_metrics(whole["metrics"], resumed["metrics"]) == []


@pytest.mark.exhaustive
def test_a_moe_policy_takes_the_same_steps(tmp_path):
    path = tmp_path / "moe.pt"
    torch.save(cached_completions("float32", "tiny-qwen3-moe"), path)
    paths = {"float32": str(path)}
    one, two = (
        _run(tmp_path, paths, layout, "float32", model="tiny-qwen3-moe")
        for layout in (PACKED_ONE, PADDED_TWO)
    )
    assert _same_state(one["state"], two["state"]) == []
    assert _same_metrics(one["metrics"], two["metrics"]) == []
    assert "router/max_load_share" in one["metrics"][0]


@pytest.mark.exhaustive
def test_mini_batches_and_epochs_take_the_same_steps(tmp_path, completions):
    split = {"mini_batch_size": 4, "epochs": 2}
    runs = [
        _run(tmp_path, completions, (world, stage, {**trainer, **split}), "bfloat16", steps=2)
        for world, stage, trainer in (PACKED_ONE, SINGLES_FOUR)
    ]
    assert _same_state(runs[0]["state"], runs[1]["state"]) == []
    assert _same_metrics(runs[0]["metrics"], runs[1]["metrics"]) == []
    assert runs[0]["metrics"][0]["updates"] == 4


@pytest.mark.exhaustive
def test_the_kl_penalty_keeps_the_steps_alike(tmp_path, completions):
    one, two = (
        _run(tmp_path, completions, layout, "bfloat16", kl_coef=0.05)
        for layout in (PACKED_ONE, PADDED_TWO)
    )
    assert _same_state(one["state"], two["state"]) == []
    assert _same_metrics(one["metrics"], two["metrics"]) == []
    assert one["metrics"][-1]["kl"] > 0


@pytest.mark.exhaustive
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_every_loss_aggregation_keeps_the_steps_alike(tmp_path, completions, aggregation):
    algorithm = {"loss_aggregation": aggregation, "clip_eps_high": 0.28}
    one, two = (
        _run(tmp_path, completions, layout, "bfloat16", algorithm=algorithm)
        for layout in (PACKED_ONE, SINGLES_FOUR)
    )
    assert _same_state(one["state"], two["state"]) == []
    assert _same_metrics(one["metrics"], two["metrics"]) == []
