"""What every rank of a worker-matrix cell must report: parity before and after training,
sane metrics, an exact resume."""

from __future__ import annotations

import math

import torch

from tests.helpers.worker.cell import cell_config


def check_cell(results: list[dict], stage: int, dtype: str) -> None:
    config = cell_config(stage, len(results), dtype)
    global_tokens = sum(int(r["mask"].sum()) for r in results)
    for r in results:
        _check_initial_parity(r)
        _check_metrics(r["metrics"], config, global_tokens, r.get("timings"))
        _check_new_rollout_parity(r)
        _check_resume(r)
        if stage == 3:
            assert r["lm_head_numel_outside_forward"] == 0, (
                "ZeRO-3 should partition the LM-head weight"
            )
            assert r["external_params"], "LM-head weight not registered as an external parameter"
    # Metrics are all-reduced: every rank reports the same numbers.
    assert all(r["metrics"] == results[0]["metrics"] for r in results)


def _check_initial_parity(r: dict) -> None:
    mask = r["mask"]
    assert torch.equal(r["lp0"][mask], r["rollout_lp"][mask]), (
        "trainer != rollout logprobs before training"
    )
    assert torch.count_nonzero(r["lp0"][~mask]) == 0, "unscored positions must be 0"
    assert r["lp0"].dtype == torch.float32


def _check_metrics(metrics: list[dict], config, global_tokens: int, timings) -> None:
    first = metrics[0]
    assert first["parity/exact_match_fraction"] == 1.0 and first["parity/max_abs_diff"] == 0.0
    assert first["parity/num_tokens"] == global_tokens == first["tokens"]
    assert first["parity/kl"] == 0.0 and first["kl"] == 0.0, (
        "policy == reference before the first update"
    )
    assert metrics[1]["kl"] > 0.0, "KL to the reference must grow once the policy moved"
    losses = [m["loss"] for m in metrics]
    assert all(b < a for a, b in zip(losses, losses[1:])), (
        f"loss not decreasing on a fixed batch: {losses} ({timings})"
    )
    for m in metrics:
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, m
        assert m["lr"] == config.trainer.lr and math.isfinite(m["entropy"]) and m["entropy"] > 0
        assert 0.0 <= m["clip_fraction"] <= 1.0
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]


def _check_new_rollout_parity(r: dict) -> None:
    mask = r["new_mask"]
    assert torch.equal(r["new_lp"][mask], r["new_rollout_lp"][mask]), (
        "exported weights: rollout != trainer"
    )


def _check_resume(r: dict) -> None:
    if r["rank"] == 0:  # the weights file rank 0 wrote == export_weights, tied names one tensor
        assert r["weights_file_diff"] == []
        assert r["weights_file_tied"] == (["lm_head.weight"] if r["tied"] else [])
    assert r["resumed_step"] == 1 and r["resumed_version"] == 1
    assert r["resumed_metrics"] == r["metrics"][1], (
        "resumed step 2 differs from the uninterrupted step 2"
    )
    if r["rank"] == 0:
        assert r["resume_weight_diff"] == [], (
            f"weights differ after resume: {r['resume_weight_diff']}"
        )
