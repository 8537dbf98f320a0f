"""trainer.layout_invariant with GSPO's sequence ratios and with each rollout correction, on
real DeepSpeed ranks (gloo): one rank ZeRO-0 with one packed micro-batch of 8 and two ZeRO-3
ranks with padded micro-batches of 2 end every step with the same weights and AdamW moments,
bit for bit, and write the same metrics (all but time/*). Negative control: the same pair
with the flag off differs. The per-sequence reduction itself: tests/exact/test_float_sums.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.worker.layout_runs import (
    PACKED_ONE,
    PADDED_TWO,
    run_layout,
    same_metrics,
    same_state,
)

GSPO = {"ratio_level": "sequence", "loss_aggregation": "seq-mean-token-mean"}
# step 1 is on-policy (every ratio exactly 1); from step 2 on the trainer has moved off the
# rollout's policy (lr 1e-3: token ratios from ~0.4 to ~2), so with C = 1.5 every mode
# truncates or drops some tokens but not all
THRESHOLD = 1.5
ACTS = {  # mode -> the metric that shows it did something
    "token_truncate": "correction/truncated_fraction",
    "token_mask": "correction/masked_fraction",
    "sequence_truncate": "correction/truncated_fraction",
    "sequence_mask": "correction/masked_sequence_fraction",
}


def _pair(tmp_path, completions, *, invariant=True, **extra):
    return [
        run_layout(tmp_path, completions, layout, "bfloat16", invariant=invariant, **extra)
        for layout in (PACKED_ONE, PADDED_TWO)
    ]


def test_gspo_takes_the_same_steps_in_two_layouts(tmp_path, completions):
    one, two = _pair(tmp_path, completions, algorithm=GSPO)
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert int(one["state"]["step"]) == 3


@pytest.mark.exhaustive
@pytest.mark.parametrize("mode", sorted(ACTS))
def test_each_rollout_correction_takes_the_same_steps_in_two_layouts(
    tmp_path,
    completions,
    mode,
):
    algorithm = {"rollout_correction": mode, "correction_threshold": THRESHOLD}
    one, two = _pair(tmp_path, completions, algorithm=algorithm)
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    _assert_acts(one["metrics"], mode)


@pytest.mark.exhaustive  # make test: GSPO alone (above)
def test_a_sequence_mask_correction_under_gspo_takes_the_same_steps(tmp_path, completions):
    algorithm = {**GSPO, "rollout_correction": "sequence_mask", "correction_threshold": THRESHOLD}
    one, two = _pair(tmp_path, completions, algorithm=algorithm)
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    _assert_acts(one["metrics"], "sequence_mask")


def test_negative_control_gspo_with_a_correction_differs_with_the_flag_off(
    tmp_path,
    completions,
):
    algorithm = {**GSPO, "rollout_correction": "token_truncate", "correction_threshold": THRESHOLD}
    one, two = _pair(tmp_path, completions, invariant=False, algorithm=algorithm)
    assert same_state(one["state"], two["state"]) != []


def _assert_acts(metrics: list[dict], mode: str) -> None:
    """Not vacuous: the ratios are not all 1 and the mode truncated or dropped something."""
    assert any(m["correction/ratio_max"] > 1.0 or m["correction/ratio_min"] < 1.0 for m in metrics)
    assert any(0 < m[ACTS[mode]] < 1 for m in metrics), [m[ACTS[mode]] for m in metrics]
