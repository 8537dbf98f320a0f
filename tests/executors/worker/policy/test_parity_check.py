"""The worker's parity check (executors/worker/policy/parity_check.py) on one rank: 'off'
compares nothing and reports no metrics; 'report' sums the micro-batch's mismatches; 'strict'
raises ParityError naming the first mismatching token, and passes where the trainer's logprobs
are the rollout's bit for bit (the control). Per-sequence records total the plain sums; an
observation token (off the response mask) is never compared."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.errors import ParityError
from rl_engine.executors.worker.micro_batches import plan
from rl_engine.executors.worker.policy.parity_check import ParityCheck
from tests.helpers.worker.completions import two_groups

ONE_RANK = Collectives(0, 1, torch.device("cpu"))


@pytest.fixture
def micro():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    (micro,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    return micro


def _perturbed(micro):
    """The rollout's logprobs with row 0's second completion token (position 3) moved."""
    logp = micro.batch.rollout_logprobs.clone()
    logp[0, 3] += 0.5
    return logp


def test_off_compares_nothing(micro):
    check = ParityCheck("off", ONE_RANK)
    assert not check.active
    sums = check.check(micro, _perturbed(micro))
    assert sums.tokens == 0 and check.metrics(sums) is None


def test_report_counts_the_mismatches_and_strict_passes_equal_logprobs(micro):
    tokens = int(micro.batch.response_mask.sum())
    equal = micro.batch.rollout_logprobs.clone()
    for mode in ("report", "strict"):
        sums = ParityCheck(mode, ONE_RANK).check(micro, equal)
        assert (sums.tokens, sums.mismatches) == (tokens, 0)
    report = ParityCheck("report", ONE_RANK)
    sums = report.check(micro, _perturbed(micro))
    assert (sums.tokens, sums.mismatches, sums.abs_max) == (tokens, 1, 0.5)
    metrics = report.metrics(sums)
    assert metrics.num_tokens == tokens and metrics.max_abs_diff == 0.5


def test_strict_names_the_first_mismatching_token(micro):
    with pytest.raises(ParityError, match="rank 0, sequence 0 of the shard, completion token 1"):
        ParityCheck("strict", ONE_RANK).check(micro, _perturbed(micro))


def test_an_empty_micro_batch_adds_nothing(micro):
    for per_sequence in (False, True):
        check = ParityCheck("strict", ONE_RANK, per_sequence=per_sequence)
        assert type(check.check(None, torch.zeros(0))) is type(check.empty())


def test_per_sequence_records_total_the_plain_sums(micro):
    logp = _perturbed(micro)
    plain = ParityCheck("report", ONE_RANK).check(micro, logp)
    per_sequence = ParityCheck("report", ONE_RANK, per_sequence=True)
    records = per_sequence.check(micro, logp)
    assert len(records.records) == micro.batch.input_ids.shape[0]
    assert [r.mismatches for r in records.records] == [1, 0, 0, 0]
    total = records.total(ONE_RANK.all_gather)
    assert (total.tokens, total.exact, total.abs_max) == (plain.tokens, plain.exact, 0.5)
    assert per_sequence.metrics(records).num_tokens == plain.tokens


def test_an_observation_tokens_logprob_is_not_compared(micro):
    off_mask = (~micro.batch.response_mask).nonzero()[0].tolist()
    logp = micro.batch.rollout_logprobs.clone()
    logp[off_mask[0], off_mask[1]] += 1.0
    sums = ParityCheck("strict", ONE_RANK).check(micro, logp)
    assert sums.mismatches == 0
