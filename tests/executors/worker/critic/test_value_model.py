"""The critic's value model (executors/worker/critic/value_model.py) on the batch-invariant tiny
Llama, in-process: the head starts at zero, so every value is 0 (every rank and run starts at
V = 0); with a head set, a sequence's values padded == packed (moved back to the padded view)
on its tokens, with torch.equal. Control (the comparison sees a change): another head bias
gives other values. The head is a (1, H) weight and a bias in the backbone's dtype."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.critic.value_model import ValueModule
from rl_engine.executors.worker.micro_batches import plan
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from tests.helpers.worker.completions import two_groups


@pytest.fixture
def value_module() -> ValueModule:
    """A fresh one per test: a test sets its head."""
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16, seed=2)
    apply_batch_invariant(model)
    return ValueModule(model)


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    comps, rewards = two_groups()
    return TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def _values(module: ValueModule, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded, packed moved to the padded view) values of the whole batch."""
    (padded,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    (packed,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=True)
    p = packed.packed
    with torch.no_grad():
        from_padded = module(batch.input_ids, batch.attention_mask)
        from_packed = packed.logprobs_view(module(p.input_ids, None, p.positions, p.segments))
    return from_padded, from_packed


def test_the_head_starts_at_zero_so_every_value_is_zero(value_module, batch):
    head = value_module.head
    hidden = value_module.backbone.config.hidden_size
    assert head.weight.shape == (1, hidden) and head.weight.dtype == torch.bfloat16
    padded, _ = _values(value_module, batch)
    assert padded.shape == batch.response_mask.shape and padded.dtype == torch.float32
    assert torch.equal(padded, torch.zeros_like(padded))


def test_values_padded_and_packed_are_the_same_bits(value_module, batch):
    generator = torch.Generator().manual_seed(0)
    head = value_module.head
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator))
        head.bias.fill_(0.25)
    padded, packed = _values(value_module, batch)
    mask = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    assert torch.equal(packed[mask], padded[mask])
    with torch.no_grad():
        head.bias.fill_(0.5)
    other, _ = _values(value_module, batch)
    assert not torch.equal(other[mask], padded[mask])  # control
