"""rl_engine.logprobs.parity: importance-ratio distribution, mismatch by position and correction step metrics, on hand-made logprobs."""

import math

import pytest
import torch

from rl_engine.logprobs.parity import fraction_outside, mismatch_by_position, ratio_distribution


def test_ratio_distribution_counts_tokens_and_sequences_outside_the_band():
    rollout = [torch.zeros(3), torch.zeros(2)]
    # token log-ratios: seq 0 -> [ln 3, 0, 0], seq 1 -> [-ln 1.8, -ln 1.8] (sequence ratio 1/3.24)
    trainer = [torch.tensor([math.log(3.0), 0.0, 0.0]), torch.full((2,), -math.log(1.8))]
    d = ratio_distribution(trainer, rollout)
    assert d["token"]["min"] == pytest.approx(1 / 1.8) and d["token"]["max"] == pytest.approx(3.0)
    assert d["token"]["outside"] == {"1.5": 3 / 5, "2.0": 1 / 5, "5.0": 0.0}
    assert d["sequence"]["outside"] == {"1.5": 1.0, "2.0": 1.0, "5.0": 0.0}
    assert d["token"]["quantiles"]["0.5"] == pytest.approx(1.0)
    exact = ratio_distribution(rollout, [r.clone() for r in rollout])
    assert exact["token"]["min"] == exact["token"]["max"] == 1.0
    with pytest.raises(ValueError, match="threshold must be > 1"):
        fraction_outside(torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="sequence 1: trainer logprobs"):
        ratio_distribution(trainer, [torch.zeros(3), torch.zeros(3)])


def test_mismatch_by_position_averages_over_the_sequences_that_reach_it():
    trainer = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5])]
    rollout = [torch.tensor([-1.0, -2.5, -3.0]), torch.tensor([-1.0])]
    p = mismatch_by_position(trainer, rollout)
    assert p["tokens"] == [2, 1, 1]
    assert p["exact_match_fraction"] == [0.5, 0.0, 1.0]
    assert p["mean_abs_diff"] == [0.25, 0.5, 0.0] and p["max_abs_diff"] == [0.5, 0.5, 0.0]


def test_step_metrics_merge_over_micro_batches_and_report_what_the_correction_did():
    from rl_engine.algorithms import rollout_correction
    from rl_engine.logprobs.parity import CorrectionSums, correction_sums

    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, float("nan")]])
    trainer = rollout + torch.tensor([[0.0, math.log(3.0), 0.0], [math.log(0.25), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    total = CorrectionSums()
    for rows in (slice(0, 1), slice(1, 2)):  # two micro-batches
        c = rollout_correction(
            trainer[rows], rollout[rows], mask[rows], mode="token_mask", threshold=2.0
        )
        total = total.merge(correction_sums(trainer[rows], rollout[rows], mask[rows], c))
    m = total.metrics()
    assert m["correction/ratio_max"] == pytest.approx(3.0) and m[
        "correction/ratio_min"
    ] == pytest.approx(0.25)
    assert m["correction/ratio_mean"] == pytest.approx((1 + 3 + 1 + 0.25 + 1) / 5)
    assert (
        m["correction/masked_fraction"] == pytest.approx(2 / 5)
        and m["correction/truncated_fraction"] == 0
    )
    assert m["correction/masked_sequence_fraction"] == 0.0 and m["correction/k3_kl"] > 0
    assert m["correction/rollout_ppl"] == pytest.approx(math.exp(5.7 / 5), rel=1e-6)
    assert m["correction/trainer_ppl"] < m["correction/rollout_ppl"] * 3


def test_step_metrics_of_non_finite_logprobs_are_reported_not_raised():
    from rl_engine.algorithms import rollout_correction
    from rl_engine.logprobs.parity import correction_sums

    rollout = torch.tensor([[-1.0, -2.0]])
    trainer = torch.tensor([[-1.0, -float("inf")]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    c = rollout_correction(trainer, rollout, mask, mode="token_truncate", threshold=2.0)
    m = correction_sums(trainer, rollout, mask, c).metrics()
    assert m["correction/trainer_ppl"] == math.inf and m["correction/ratio_min"] == 0.0
