"""Packed rows' bookkeeping (common/segments.py): which sequence each query and key belongs to.

Checked on a hand-worked call: `sequences_of` numbers the (row, segment) pairs that have a live
query in (row, segment id) order, whatever the ids' values; it maps padding queries, empty key
slots and keys of a segment no query asks for to -1; `sequence_lengths` is each sequence's
largest query position + 1; `check_distinct_positions` names a repeated position; a call of
padding only has no sequences.
"""

import pytest
import torch

from rl_engine.kernels.common.segments import (
    check_distinct_positions,
    sequence_lengths,
    sequences_of,
)

# row 0: segment 4 (positions 0, 1), then segment 1 (0, 1, 2); row 1: segment 7 (0..3), a padding
# query; keys: the same slots, plus one of segment 5 (row 0) and of segment 0 (row 1), unqueried
Q_POSITIONS = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, -1]])
Q_SEGMENTS = torch.tensor([[4, 4, 1, 1, 1], [7, 7, 7, 7, 0]])
K_POSITIONS = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, -1, 0]])
K_SEGMENTS = torch.tensor([[4, 4, 1, 1, 1, 5], [7, 7, 7, 7, 0, 0]])


def test_sequences_are_numbered_by_row_then_segment_id():
    seqs = sequences_of(Q_POSITIONS, Q_SEGMENTS, K_POSITIONS, K_SEGMENTS)
    assert seqs.count == 3  # (0, segment 1), (0, segment 4), (1, segment 7)
    assert seqs.row.tolist() == [0, 0, 1]
    assert seqs.q_seq.tolist() == [[1, 1, 0, 0, 0], [2, 2, 2, 2, -1]]
    assert seqs.k_seq.tolist() == [[1, 1, 0, 0, 0, -1], [2, 2, 2, 2, -1, -1]]
    assert sequence_lengths(Q_POSITIONS, seqs).tolist() == [3, 2, 4]
    check_distinct_positions(Q_POSITIONS, seqs)


def test_the_numbering_does_not_depend_on_the_ids_values():
    shifted = sequences_of(Q_POSITIONS, Q_SEGMENTS - 50, K_POSITIONS, K_SEGMENTS - 50)
    seqs = sequences_of(Q_POSITIONS, Q_SEGMENTS, K_POSITIONS, K_SEGMENTS)
    assert shifted.count == seqs.count
    for got, want in ((shifted.q_seq, seqs.q_seq), (shifted.k_seq, seqs.k_seq)):
        assert torch.equal(got, want)


def test_a_repeated_position_in_one_sequence_is_named():
    segments = torch.tensor([[4, 4, 4, 1, 1], [7, 7, 7, 7, 0]])  # positions 0, 1, 0 in segment 4
    seqs = sequences_of(Q_POSITIONS, segments, K_POSITIONS, K_SEGMENTS)
    with pytest.raises(ValueError, match="q_positions: a sequence has the same position twice"):
        check_distinct_positions(Q_POSITIONS, seqs)


def test_a_call_of_padding_only_has_no_sequences():
    padding = torch.full((2, 5), -1)
    seqs = sequences_of(padding, Q_SEGMENTS, K_POSITIONS, K_SEGMENTS)
    assert seqs.count == 0 and seqs.row.numel() == 0
    assert bool((seqs.q_seq == -1).all()) and bool((seqs.k_seq == -1).all())
    assert seqs.k_seq.shape == K_POSITIONS.shape
    assert sequence_lengths(padding, seqs).numel() == 0
