"""CriticWorker's recovery from an exception mid-step, as the policy worker's (1 rank, ZeRO-0).

An exception before any backward leaves the critic usable; one after a backward leaves
gradients inside DeepSpeed, so the critic refuses further calls.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors import CriticWorker
from tests.helpers.worker.cell import cached_completions, to_batch
from tests.helpers.worker.critic_setup import critic_config, gae_returns


def _fail_forward(worker: CriticWorker, call: int) -> None:
    """The value head raises on its `call`-th forward from now (1: the next one)."""
    head, calls = worker.module.head, []
    original = head.forward

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected failure mid-step")
        return original(*args, **kwargs)

    head.forward = failing


def test_an_exception_after_a_backward_makes_the_critic_refuse_further_calls():
    batch = to_batch(cached_completions("float32"))
    worker = CriticWorker(critic_config({"micro_batch_size": 2}), device="cpu")
    values = worker.values(batch)
    returns = gae_returns(batch, values)
    _fail_forward(worker, call=2)  # the second micro-batch: after the first one's backward
    with pytest.raises(RuntimeError, match="injected failure mid-step"):
        worker.train_step(batch, returns, values)
    del worker.module.head.forward
    unusable = "unusable: an earlier call raised RuntimeError and gradients were already"
    with pytest.raises(RuntimeError, match=unusable):
        worker.train_step(batch, returns, values)
    with pytest.raises(RuntimeError, match=unusable):
        worker.values(batch)


def test_an_exception_before_any_backward_leaves_the_critic_usable():
    batch = to_batch(cached_completions("float32"))
    worker = CriticWorker(critic_config({"micro_batch_size": 2}), device="cpu")
    values = worker.values(batch)
    returns = gae_returns(batch, values)
    _fail_forward(worker, call=1)
    with pytest.raises(RuntimeError, match="injected failure mid-step"):
        worker.train_step(batch, returns, values)
    del worker.module.head.forward
    metrics = worker.train_step(batch, returns, values)
    assert metrics["critic/updates"] == 1 and metrics["critic/skipped_update"] == 0
    assert not torch.equal(worker.values(batch), values)
