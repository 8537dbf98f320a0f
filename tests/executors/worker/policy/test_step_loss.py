"""One training step's arithmetic (executors/worker/policy/step_loss.py) on a four-sequence
batch: with the trainer's logprobs the rollout's (ratio 1) the token-mean policy loss is minus
the tokens' mean advantage, times the micro-batch's share of the step's tokens, times
DeepSpeed's scale; a row moved past the clip counts its tokens as clipped; the k3 KL to an
equal reference is 0. The step's metrics are means over updates and tokens, with the skip's
reason (non-finite loss or gradient) and the parity figures in the log line."""

from __future__ import annotations

import math

import pytest

from rl_engine.config import AlgorithmConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.policy.step_loss import (
    LossSums,
    micro_loss,
    step_metrics,
    summary,
)
from rl_engine.logprobs.parity import MismatchMetrics, ParitySums
from tests.helpers.worker.completions import two_groups


@pytest.fixture
def batch() -> TrainBatch:
    comps, rewards = two_groups()
    return TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_at_ratio_one_the_loss_is_minus_the_mean_advantage_times_share_and_scale(batch):
    mask = batch.response_mask
    tokens = int(mask.sum())
    mean_advantage = float((batch.advantages[:, None] * mask).sum()) / tokens
    logp = batch.rollout_logprobs.clone()
    algo = AlgorithmConfig()
    loss, sums = micro_loss(algo, batch, logp, None, units=2 * tokens, scale=4)
    assert isinstance(sums, LossSums)
    assert math.isclose(sums.policy_loss, -mean_advantage / 2, abs_tol=1e-7)
    assert math.isclose(float(loss.detach()), 4 * sums.loss, rel_tol=1e-6)
    assert (sums.clipped, sums.kl, sums.tokens) == (0.0, 0.0, tokens)
    assert sums.neg_logp == -float(logp[mask].sum())


def test_a_row_past_the_clip_counts_its_tokens_and_an_equal_reference_has_no_kl(batch):
    mask = batch.response_mask
    logp = batch.rollout_logprobs.clone()
    logp[0] += 1.0  # ratio e > 1 + clip_eps on row 0 (advantage > 0): clipped
    assert float(batch.advantages[0]) > 0
    algo = AlgorithmConfig(kl_coef=0.5)
    reference = logp.clone()
    _, sums = micro_loss(algo, batch, logp, reference, units=int(mask.sum()), scale=1)
    assert sums.clipped == float(mask[0].sum())
    assert sums.kl == 0.0 and sums.loss == sums.policy_loss


def test_step_metrics_are_means_over_updates_and_tokens():
    sums = LossSums(loss=1.0, policy_loss=0.5, clipped=3.0, kl=0.25, neg_logp=20.0, tokens=10.0)
    m = step_metrics(sums, None, 0, updates=2, epochs=2, grad_norm=1.5)
    assert m == {
        "loss": 0.5,
        "policy_loss": 0.25,
        "clip_fraction": 0.3,
        "kl": 0.125,
        "entropy": 2.0,
        "tokens": 5,
        "grad_norm": 1.5,
        "updates": 2,
        "skipped_update": 0,
    }
    assert step_metrics(LossSums(), None, 0, updates=0)["loss"] == 0.0  # a warm-up step


def test_a_skipped_step_names_its_reason_in_the_metrics_and_the_log_line():
    bad_loss = LossSums(loss=math.nan, tokens=4.0)
    m = step_metrics(bad_loss, None, 1, step=3, grad_norm=math.inf)
    assert m["skip_reason"] == "non-finite loss"
    assert "SKIPPED (non-finite loss)" in summary(m)
    m = step_metrics(LossSums(loss=1.0, tokens=4.0), None, 1, step=3, grad_norm=math.inf)
    assert m["skip_reason"] == "non-finite gradient"
    line = summary(step_metrics(LossSums(tokens=4.0), None, 0, step=3, grad_norm=0.5))
    assert line.startswith("step 3: loss +0.00000") and "SKIPPED" not in line
    assert "parity" not in line
    parity = MismatchMetrics.from_sums(ParitySums(exact=3.0, tokens=4.0, abs_sum=0.5, abs_max=0.5))
    m = step_metrics(LossSums(tokens=4.0), parity, 0, step=3, grad_norm=0.5)
    assert m["parity/exact_match_fraction"] == 0.75
    assert "| parity exact 0.7500 max|d| 5.00e-01" in summary(m)
