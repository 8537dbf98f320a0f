"""A step's rollout-correction bookkeeping (executors/worker/policy/step_corrections.py) on one
rank, two mini-batches of two sequences each: which modes need the scoring pass; under a mask
mode a token whose trainer/rollout ratio leaves the band is dropped from its mini-batch's
normaliser and counted in correction/masked_fraction, per-sequence records (layout_invariant)
counting the same; under 'none' nothing is corrected (the control: every token stays in the
normaliser); a correction asked for before it was taken is refused by name."""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import AlgorithmConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.micro_batches import plan
from rl_engine.executors.worker.policy.step_corrections import (
    StepCorrections,
    needs_scoring_pass,
)
from tests.helpers.worker.completions import two_groups

ONE_RANK = Collectives(0, 1, torch.device("cpu"))


@pytest.fixture
def minis() -> list[list[TrainBatch]]:
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    return [[mb.batch] for mb in plan(batch, micro_batch_size=2, max_tokens=0, packing=False)]


def _scored(minis) -> dict[tuple[int, int], torch.Tensor]:
    """The rollout's logprobs as the trainer's, but mini-batch 0's first token 3 nats higher."""
    scored = {(j, 0): micro[0].rollout_logprobs.clone() for j, micro in enumerate(minis)}
    first = minis[0][0].response_mask[0].nonzero()[0, 0]
    scored[(0, 0)][0, first] += 3.0
    return scored


def _tokens(micro) -> float:
    return float(micro[0].response_mask.sum())


def test_which_modes_need_the_scoring_pass():
    def need(mode, mini):
        return needs_scoring_pass(AlgorithmConfig(rollout_correction=mode), mini)

    assert [need("none", j) for j in (0, 1)] == [False, False]
    assert [need("token_truncate", j) for j in (0, 1)] == [False, True]
    assert [need("sequence_mask", j) for j in (0, 1)] == [True, True]


@pytest.mark.parametrize("per_sequence", [False, True])
def test_a_dropped_token_leaves_its_mini_batchs_normaliser(minis, per_sequence):
    algo = AlgorithmConfig(rollout_correction="token_mask", correction_threshold=2.0)
    gather = ONE_RANK.all_gather if per_sequence else None
    step = StepCorrections(algo, minis, _scored(minis), ONE_RANK.all_reduce, gather)
    assert step.units == [_tokens(minis[0]) - 1, _tokens(minis[1])]
    corrected = step.take((0, 0), minis[0][0], None)
    assert int(corrected.correction.dropped.sum()) == 1
    metrics = step.metrics(ONE_RANK.all_reduce)
    total = _tokens(minis[0]) + _tokens(minis[1])
    assert metrics["correction/masked_fraction"] == 1 / total


def test_mode_none_corrects_nothing(minis):
    step = StepCorrections(AlgorithmConfig(), minis, _scored(minis), ONE_RANK.all_reduce)
    assert step.units == [_tokens(minis[0]), _tokens(minis[1])]  # control: nothing dropped
    assert step.take((0, 0), minis[0][0], None) is None


def test_a_correction_not_taken_before_the_update_is_refused(minis):
    algo = AlgorithmConfig(rollout_correction="token_truncate")
    step = StepCorrections(algo, minis, {}, ONE_RANK.all_reduce)
    with pytest.raises(RuntimeError, match=r"no pre-update correction for micro-batch \(1, 0\)"):
        step.take((1, 0), minis[1][0], None)
    logp = minis[0][0].rollout_logprobs.clone()
    assert step.take((0, 0), minis[0][0], logp) is not None  # the first forward's, taken
