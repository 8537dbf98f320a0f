"""An asynchronous run's worker (rollout.max_staleness 1), in this process, real DeepSpeed.

The rollouts of version 0 arrive after the rank has trained to version 1: `verify_behaviour`
checks them against the snapshot of version 0 taken before the update, exactly; the controls:
the rank's current weights give other logprobs, and a rollout logprob moved by one ulp fails
the strict check. A stale batch trains (decoupled PPO: its own forward is not a parity check),
and a batch of a version the rank holds no snapshot of is refused under 'strict', never
reported exact.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker, ParityError
from tests.helpers.worker.cell import cached_completions, cell_config, nudged, to_batch


@pytest.fixture(scope="module")
def batch():
    return to_batch(cached_completions("float32"))


def test_stale_rollouts_are_checked_against_the_weights_that_sampled_them(batch):
    worker = DeepSpeedTrainingWorker(
        cell_config(0, 1, "float32", rollout={"max_staleness": 1}), device="cpu"
    )
    assert batch.weight_version == 0
    worker.train_step(batch)  # version 0 -> 1; the engines sampled with version 0 meanwhile
    checked = worker.verify_behaviour(batch)
    assert checked["parity/exact_match_fraction"] == 1.0 and checked["parity/num_tokens"] > 0
    assert checked["parity/unverified_tokens"] == 0.0
    mask = batch.response_mask
    now = worker.compute_logprobs(batch)
    assert not torch.equal(now[mask], batch.rollout_logprobs[mask])  # version 1's bits differ
    with pytest.raises(ParityError):
        worker.verify_behaviour(nudged(batch, 0))

    stale = worker.train_step(batch)  # one version old: decoupled PPO, checked above
    assert stale["weight_version"] == 2 and "parity/exact_match_fraction" not in stale
    assert stale["correction/ratio_max"] != 1.0  # the proximal/behaviour weight moved off 1
    with pytest.raises(ParityError, match="cannot check a batch of weight_version 0"):
        worker.verify_behaviour(batch)  # its snapshot is version 2's now
