"""Planning a shard's micro-batches (executors/worker/micro_batches.py): the baseline slices
consecutive full-width rows; a token budget groups sequences and trims padding-only columns;
packing concatenates a group in one row whose logprobs move back to the padded view bit for bit."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.micro_batches import MicroSlot, plan
from rl_engine.logprobs import IGNORE_INDEX
from tests.helpers.worker.completions import two_groups


@pytest.fixture
def batch() -> TrainBatch:
    comps, rewards = two_groups()
    return TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_baseline_is_consecutive_full_width_rows(batch):
    micro = plan(batch, micro_batch_size=3, max_tokens=0, packing=False)
    assert [m.sequences for m in micro] == [(0, 1, 2), (3,)]
    assert all(m.packed is None and m.batch.input_ids.shape[1] == 7 for m in micro)
    assert torch.equal(micro[1].batch.input_ids, batch.input_ids[3:])


def test_token_budget_groups_and_trims_padding(batch):
    lengths = batch.attention_mask.sum(dim=1).tolist()
    micro = plan(batch, micro_batch_size=4, max_tokens=10, packing=False, consecutive=True)
    assert sorted(s for m in micro for s in m.sequences) == [0, 1, 2, 3]
    for m in micro:
        longest = max(lengths[s] for s in m.sequences)
        assert len(m.sequences) * longest <= 10
        assert m.batch.input_ids.shape[1] == longest  # padding-only columns are gone
        assert torch.equal(m.batch.input_ids, batch.input_ids[list(m.sequences), :longest])


def test_packing_moves_logprobs_back_to_the_padded_view(batch):
    (m,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=True)
    assert m.packed is not None and m.sequences == (0, 1, 2, 3)
    targets = m.targets()
    assert targets.shape[0] == 1
    assert int((targets != IGNORE_INDEX).sum()) == batch.num_tokens
    padded = m.batch.rollout_logprobs
    packed = m.packed.pack_values(padded, 0.0)
    back = m.logprobs_view(packed)
    assert torch.equal(back[m.batch.response_mask], padded[m.batch.response_mask])


def test_unpacked_targets_ignore_everything_off_the_response_mask(batch):
    (m,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    targets = m.targets()
    assert torch.equal(
        targets[m.batch.response_mask], m.batch.input_ids[:, 1:][m.batch.response_mask]
    )
    assert (targets[~m.batch.response_mask] == IGNORE_INDEX).all()
    assert m.logprobs_view(targets) is targets


def test_micro_slot_names_its_fields():
    assert MicroSlot(1, 2, 3)._asdict() == {"epoch": 1, "mini": 2, "micro": 3}
