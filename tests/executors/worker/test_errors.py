"""The worker's errors: a BatchError keeps its ranks through pickling (Ray carries it between
processes), and a strict step's ParityError names the rank, the shard sequence, the completion
token and both logprobs of the first mismatch (or says the mismatch is on other ranks)."""

from __future__ import annotations

import pickle

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.errors import BatchError, ParityError, parity_error
from rl_engine.executors.worker.micro_batches import plan
from tests.helpers.worker.completions import two_groups


def test_batch_error_keeps_message_and_ranks_through_pickle():
    error = BatchError("rank 1: sequence 3 is empty", ranks=[1])
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, BatchError) and isinstance(copy, ValueError)
    assert str(copy) == "rank 1: sequence 3 is empty" and copy.ranks == (1,)
    assert BatchError("bad").ranks == ()


def test_parity_error_without_a_local_micro_batch_points_at_other_ranks():
    error = parity_error(2, None, None, (), 5)
    assert isinstance(error, ParityError) and error.rank == 2 and error.sequence is None
    assert str(error) == "parity: 5 mismatching token(s) on other ranks (none on rank 2)"


def test_parity_error_names_the_first_mismatching_token():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    (micro,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    logp = micro.batch.rollout_logprobs.clone()
    assert parity_error(0, logp, micro.batch, (10, 11, 12, 13), 0).sequence is None  # control
    # row 0: prompt [5, 6, 7], completion scored at positions 2 and 3; perturb its 2nd token
    logp[0, 3] += 0.5
    error = parity_error(0, logp, micro.batch, (10, 11, 12, 13), 1)
    assert (error.rank, error.sequence, error.position) == (0, 10, 3)
    assert error.trainer_logprob == float(logp[0, 3])
    assert error.rollout_logprob == float(micro.batch.rollout_logprobs[0, 3])
    assert (
        "rank 0, sequence 10 of the shard, completion token 1 (position 3 scores token 4)"
        in str(error)
    )
    assert "no optimizer step was taken" in str(error)
