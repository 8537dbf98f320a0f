"""The policy's logprob module (executors/worker/policy/logprob_module.py) on the batch-invariant
tiny Llama, in-process.

Equality chain: a micro-batch's logprobs padded == packed (moved back to the padded view), on
the response mask, with torch.equal; off the mask they are 0. Control (the comparison sees a
change): the same micro-batch at another temperature gives other logprobs. The empty
micro-batch's forward is one 0 on the autograd graph. The KL reference is a frozen, evaluating
deep copy: a later change of the policy's weights does not reach it."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.micro_batches import plan
from rl_engine.executors.worker.policy.logprob_module import (
    LogprobModule,
    frozen_copy,
    micro_batch_logprobs,
)
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from tests.helpers.worker.completions import two_groups

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def module() -> LogprobModule:
    model, _ = load_model("tiny-llama", seed=1)
    apply_batch_invariant(model)
    return LogprobModule(model)


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    comps, rewards = two_groups()
    return TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_padded_and_packed_micro_batches_give_the_same_logprobs(module, batch):
    (padded,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    (packed,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=True)
    with torch.no_grad():
        from_padded = micro_batch_logprobs(module, padded, CPU)
        from_packed = micro_batch_logprobs(module, packed, CPU)
        hotter = module(batch.input_ids, batch.attention_mask, padded.targets(), 2.0)
    mask = batch.response_mask
    assert from_padded.shape == mask.shape and from_padded.dtype == torch.float32
    assert torch.equal(from_packed[mask], from_padded[mask])
    assert (from_padded[~mask] == 0).all() and (from_padded[mask] < 0).all()
    assert batch.logprob_temperature != 2.0
    assert not torch.equal(hotter[mask], from_padded[mask])  # control


def test_the_empty_micro_batch_is_one_zero_on_the_graph(module):
    logp = micro_batch_logprobs(module, None, CPU)
    assert logp.shape == (1, 1) and float(logp.detach()) == 0.0
    assert logp.requires_grad


def test_the_reference_is_a_frozen_copy(batch):
    model, _ = load_model("tiny-llama", seed=1)
    policy = LogprobModule(model)
    reference = frozen_copy(model)
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    (padded,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    with torch.no_grad():
        before = micro_batch_logprobs(reference, padded, CPU)
        for param in model.parameters():
            param.add_(0.5)
        after = micro_batch_logprobs(reference, padded, CPU)
        moved = micro_batch_logprobs(policy, padded, CPU)
    assert torch.equal(after, before)
    assert not torch.equal(moved, before)  # control: the policy itself did change
