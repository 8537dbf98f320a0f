"""trainer.layout_invariant with GSPO's sequence ratios and with each rollout correction, on
real DeepSpeed ranks (gloo): one rank ZeRO-0 with one packed micro-batch of 8 and two ZeRO-3
ranks with padded micro-batches of 2 end every step with the same weights and AdamW moments,
bit for bit, and write the same metrics (all but time/*). Negative control: the same pair
with the flag off differs. The per-sequence reduction itself: tests/exact/test_float_sums.py.
The selected tests' runs share one request per world size (the `runs` fixture).
"""

from __future__ import annotations

import pytest

from tests.helpers.worker.launch import selected_runs
from tests.helpers.worker.layout_runs import layout_pair, run_layouts, same_metrics, same_state

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


def _correction(mode: str, **algorithm) -> dict:
    return {**algorithm, "rollout_correction": mode, "correction_threshold": THRESHOLD}


# each test's runs, each a pair of layouts (PACKED_ONE, PADDED_TWO); the module's selected
# tests' runs share one request per world size (the `runs` fixture)
RUNS = {
    "test_gspo_takes_the_same_steps_in_two_layouts": layout_pair("gspo", algorithm=GSPO),
    **{
        f"test_each_rollout_correction_takes_the_same_steps_in_two_layouts[{mode}]": layout_pair(
            mode, algorithm=_correction(mode)
        )
        for mode in ACTS
    },
    "test_a_sequence_mask_correction_under_gspo_takes_the_same_steps": layout_pair(
        "gspo_sequence_mask", algorithm=_correction("sequence_mask", **GSPO)
    ),
    "test_negative_control_gspo_with_a_correction_differs_with_the_flag_off": layout_pair(
        "plain_gspo_token_truncate",
        invariant=False,
        algorithm=_correction("token_truncate", **GSPO),
    ),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, completions) -> dict:
    out_dir = tmp_path_factory.mktemp("algos")
    return run_layouts(out_dir, completions, selected_runs(request, RUNS))


def _pair(runs: dict, name: str) -> tuple[dict, dict]:
    return runs[f"{name}/one"], runs[f"{name}/two"]


def test_gspo_takes_the_same_steps_in_two_layouts(runs):
    one, two = _pair(runs, "gspo")
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert int(one["state"]["step"]) == 3


@pytest.mark.exhaustive
@pytest.mark.parametrize("mode", sorted(ACTS))
def test_each_rollout_correction_takes_the_same_steps_in_two_layouts(runs, mode):
    one, two = _pair(runs, mode)
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    _assert_acts(one["metrics"], mode)


@pytest.mark.exhaustive  # make test: GSPO alone (above)
def test_a_sequence_mask_correction_under_gspo_takes_the_same_steps(runs):
    one, two = _pair(runs, "gspo_sequence_mask")
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    _assert_acts(one["metrics"], "sequence_mask")


def test_negative_control_gspo_with_a_correction_differs_with_the_flag_off(runs):
    one, two = _pair(runs, "plain_gspo_token_truncate")
    assert same_state(one["state"], two["state"]) != []


def _assert_acts(metrics: list[dict], mode: str) -> None:
    """Not vacuous: the ratios are not all 1 and the mode truncated or dropped something."""
    assert any(m["correction/ratio_max"] > 1.0 or m["correction/ratio_min"] < 1.0 for m in metrics)
    assert any(0 < m[ACTS[mode]] < 1 for m in metrics), [m[ACTS[mode]] for m in metrics]
