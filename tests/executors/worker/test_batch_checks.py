"""Checks of a shard before any forward (executors/worker/batch_checks.py): a step's shard is
planned into mini-batches of micro-batches whose sequences are rows of the whole shard; a wrong
sequence count, a stale weight version, a non-TrainBatch or a sequence over the token budget is a
BatchError naming the bad value; a failing check on one rank becomes a BatchError naming it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.batch_checks import (
    agree_on_batch,
    micro_batches,
    step_mini_batches,
)
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.errors import BatchError
from tests.helpers.worker.completions import two_groups

CPU = torch.device("cpu")


@pytest.fixture
def batch() -> TrainBatch:
    comps, rewards = two_groups()
    return TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_mini_batches_hold_rows_of_the_whole_shard(batch):
    minis = step_mini_batches(
        batch, vocab_size=1000, micro_batch_size=1, device=CPU, sequences=4, mini_batch=2
    )
    assert [[mb.sequences for mb in mini] for mini in minis] == [[(0,), (1,)], [(2,), (3,)]]
    assert torch.equal(minis[1][1].batch.input_ids, batch.input_ids[3:])


def test_a_wrong_sequence_count_names_both_counts(batch):
    with pytest.raises(BatchError, match=r"shard has 4 sequences; .* = 2 x 3 = 6 per rank"):
        step_mini_batches(
            batch, vocab_size=1000, micro_batch_size=3, device=CPU, sequences=6, mini_batch=6
        )


def test_a_stale_batch_names_both_versions(batch):
    stale = dataclasses.replace(batch, weight_version=3)
    kwargs = dict(vocab_size=1000, micro_batch_size=2, device=CPU, sequences=4, mini_batch=4)
    assert len(step_mini_batches(stale, weight_version=3, **kwargs)) == 1  # control: same version
    with pytest.raises(
        BatchError, match="sampled by weight_version 3 but the worker's weights are version 4"
    ):
        step_mini_batches(stale, weight_version=4, **kwargs)


def test_bad_inputs_to_scoring_are_named(batch):
    with pytest.raises(BatchError, match="batch must be a TrainBatch, got dict"):
        micro_batches({}, vocab_size=1000, micro_batch_size=1, device=CPU)
    with pytest.raises(BatchError, match=r"trainer\.max_tokens_per_micro_batch = 4\)"):
        micro_batches(batch, vocab_size=1000, micro_batch_size=4, device=CPU, max_tokens=4)
    planned = micro_batches(batch, vocab_size=1000, micro_batch_size=4, device=CPU, max_tokens=7)
    assert sorted(s for mb in planned for s in mb.sequences) == [0, 1, 2, 3]


def test_agreement_on_one_rank_passes_or_names_the_failure(batch):
    comm = Collectives(0, 1, CPU)
    minis = [micro_batches(batch, vocab_size=1000, micro_batch_size=2, device=CPU)]
    assert agree_on_batch(comm, lambda: minis) == minis

    def failing():
        raise KeyError("input_ids")

    with pytest.raises(
        BatchError, match=r"bad batch on rank\(s\) 0; .*rank 0: KeyError: 'input_ids'"
    ) as caught:
        agree_on_batch(comm, failing)
    assert caught.value.ranks == (0,)
