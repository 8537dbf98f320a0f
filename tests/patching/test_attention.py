"""The Hugging Face attention hook (patching/attention.py): positions, masks, packed layouts.

What it checks: each backend has its own attn_implementation name; the mask function hands on
the 2-D padding mask (None when nothing is padded); positions come from the mask (cumsum - 1,
padding -1) or, unpadded, are the last Tq of Tk; transformers' packed format (positions that
restart at 0) becomes one segment per sequence, and a sequence that starts elsewhere is named
with its row and column; `PackedSegments` and the packed kwarg refuse bad tensors by name. The
hook on a patched model: a packed forward (`rl_packed`) gives each sequence the bits of its own
forward, torch.equal (negative control: the row as one sequence, b reading a's keys, does
not).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.models import load_model
from rl_engine.patching import PACKED_KWARG, PackedSegments, apply_batch_invariant, attention_name
from rl_engine.patching.attention import invariant_attention_mask, positions_from_mask


def test_each_backend_has_its_own_attention_name():
    assert attention_name("cpp") == "rl_engine_invariant_cpp" != attention_name("triton")


def test_the_mask_function_hands_on_the_padding_mask_or_none():
    full = torch.ones(2, 5, dtype=torch.long)
    assert invariant_attention_mask(2, 5, 5, attention_mask=full) is None
    padded = full.clone()
    padded[0, :3] = 0  # left padding: the last 3 keys of row 0 start with one pad
    got = invariant_attention_mask(2, 3, 3, attention_mask=padded)
    assert got.dtype == torch.bool and torch.equal(got, padded[:, 2:].bool())
    four_d = torch.zeros(2, 1, 5, 5)
    assert invariant_attention_mask(2, 5, 5, attention_mask=four_d) is four_d


def test_positions_come_from_the_mask_or_are_the_last_queries():
    q_pos, k_pos = positions_from_mask(None, 2, 2, 5, "cpu")
    assert torch.equal(q_pos, torch.tensor([[3, 4], [3, 4]])) and k_pos is None
    mask = torch.tensor([[False, True, True], [True, True, True]])
    q_pos, k_pos = positions_from_mask(mask, 2, 1, 3, "cpu")
    assert torch.equal(k_pos, torch.tensor([[-1, 0, 1], [0, 1, 2]]))
    assert torch.equal(q_pos, torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match=r"2-D padding mask of shape \(2, 4\), got \(2, 3\)"):
        positions_from_mask(mask, 2, 1, 4, "cpu")


def test_restarting_position_ids_are_one_segment_per_sequence():
    packed = PackedSegments.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert torch.equal(packed.segments, torch.tensor([[1, 1, 1, 2, 2, 3]]))
    with pytest.raises(ValueError, match=r"starts at position 5 \(row 0, column 3\)"):
        PackedSegments.from_position_ids(torch.tensor([[0, 1, 2, 5, 6]]))


def test_packed_segments_refuse_bad_tensors_by_name():
    good = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"PackedSegments.segments must be an int64 \(R, N\)"):
        PackedSegments(good, good.int())
    with pytest.raises(ValueError, match=r"positions \(1, 3\) and segments \(1, 2\)"):
        PackedSegments(good, good[:, :2])


def _last_logits(model, ids, **kwargs):
    return model(ids, **kwargs).logits[0, -1]


def test_a_packed_forward_gives_each_sequence_its_own_bits():
    model, _ = load_model("tiny-llama", seed=0)
    apply_batch_invariant(model)
    a, b = torch.randint(3, 999, (1, 4)), torch.randint(3, 999, (1, 5))
    row = torch.cat([a, b], dim=1)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    packed = PackedSegments(positions, torch.tensor([[0] * 4 + [1] * 5]))
    with torch.no_grad():
        alone = _last_logits(model, b)
        assert torch.equal(
            _last_logits(model, row, position_ids=positions, **{PACKED_KWARG: packed}), alone
        )
        assert torch.equal(_last_logits(model, row, position_ids=positions), alone)  # HF's format
        assert not torch.equal(_last_logits(model, row), alone)  # one sequence: reads a too
    with pytest.raises(ValueError, match=f"{PACKED_KWARG} must be a PackedSegments, got dict"):
        model(row, position_ids=positions, **{PACKED_KWARG: {}})
