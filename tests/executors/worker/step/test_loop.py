"""The shared step loop's all-or-none guard, armed on every update (1 rank, real DeepSpeed).

A step whose loss is non-finite is skipped and reported as such by the plain update and the
layout-free one alike. Under ZeRO-3 DeepSpeed skips a non-finite step by itself without calling
the optimizer, so a guard left unarmed would report the outcome of the step before.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rl_engine.executors import DeepSpeedTrainingWorker
from rl_engine.executors.worker.step.loop import StepLoop
from tests.helpers.worker.cell import cached_completions, cell_config, to_batch


def _infinite_loss(batch):
    """A finite but absurd rollout logprob under a negative advantage: the PPO ratio overflows."""
    logprobs, advantages = batch.rollout_logprobs.clone(), batch.advantages.clone()
    logprobs[0, int(batch.response_mask[0].nonzero()[0])] = -1e30
    advantages[0] = -1.0
    return dataclasses.replace(batch, rollout_logprobs=logprobs, advantages=advantages)


@pytest.mark.parametrize("layout_invariant", [True, False], ids=["layout_free", "plain"])
def test_a_non_finite_step_is_skipped_after_a_taken_one(layout_invariant):
    batch = to_batch(cached_completions("float32"))
    config = cell_config(
        3, 1, "float32", parity="report", trainer={"layout_invariant": layout_invariant}
    )
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    assert isinstance(worker._loop, StepLoop)  # the one loop, whichever update
    taken = worker.train_step(batch)  # the control: this one updates
    assert taken["skipped_update"] == 0 and worker.weight_version == 1
    before = worker.export_weights()
    skipped = worker.train_step(_infinite_loss(batch))
    assert skipped["skipped_update"] == 1, skipped
    assert skipped["skip_reason"] == "non-finite loss"
    assert not math.isfinite(skipped["loss"])
    assert worker.weight_version == 1 and skipped["weight_version"] == 1
    after = worker.export_weights()
    assert all(torch.equal(before[name], after[name]) for name in before)
