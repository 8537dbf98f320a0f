"""rl_engine.logprobs.packing: micro-batch plans (budget, balance, determinism) and the packed layout's maps."""

import math
import random

import pytest
import torch

from rl_engine.logprobs.packing import PackedBatch, plan_micro_batches, right_padded

# ----------------------------------------------------------------------------- plans


def _lognormal_lengths(n: int, seed: int, cap: int = 1088) -> list[int]:
    rng = random.Random(seed)
    return [min(64 + int(rng.lognormvariate(math.log(128), 1.0)), cap) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("budget", "most"), [(4096, 8), (2048, 64), (1200, 3), (5000, 100)])
def test_plan_respects_both_limits_and_uses_every_sequence_once(seed, budget, most):
    lengths = _lognormal_lengths(64, seed)
    groups = plan_micro_batches(lengths, max_sequences=most, max_tokens=budget)
    assert sorted(i for g in groups for i in g) == list(range(64))
    assert all(g == sorted(g) for g in groups)
    for g in groups:
        assert len(g) <= most and sum(lengths[i] for i in g) <= budget
    # no fewer micro-batches are possible than either limit allows
    assert len(groups) >= max(math.ceil(sum(lengths) / budget), math.ceil(64 / most))


@pytest.mark.parametrize("seed", range(4))
def test_plan_is_balanced_and_near_the_fewest_micro_batches(seed):
    lengths = _lognormal_lengths(64, seed)
    groups = plan_micro_batches(lengths, max_sequences=64, max_tokens=4096)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) <= math.ceil(sum(lengths) / 4096) + 1
    assert max(loads) - min(loads) <= max(lengths), loads  # no micro-batch left nearly empty


def test_plan_depends_on_the_lengths_only_and_breaks_ties_by_index():
    lengths = [7, 3, 7, 3, 9, 1, 7]
    first = plan_micro_batches(lengths, max_sequences=3, max_tokens=12)
    assert first == plan_micro_batches(list(lengths), max_sequences=3, max_tokens=12)
    equal = plan_micro_batches([5] * 6, max_sequences=6, max_tokens=10)
    assert equal == [[0, 3], [1, 4], [2, 5]]  # longest first, ties by index, least-loaded bin


def test_plan_without_a_budget_is_consecutive_slices():
    assert plan_micro_batches([5, 1, 9, 2, 2], max_sequences=2) == [[0, 1], [2, 3], [4]]


def test_padded_plan_counts_padding():
    lengths = [10, 9, 2, 2, 2, 2]
    groups = plan_micro_batches(lengths, max_sequences=6, max_tokens=20, padded=True)
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 20
    packed = plan_micro_batches(lengths, max_sequences=6, max_tokens=20)
    assert len(packed) < len(groups) or all(sum(lengths[i] for i in g) <= 20 for g in packed)


def test_a_sequence_longer_than_the_budget_names_both_numbers():
    with pytest.raises(
        ValueError, match="sequence 2 has 30 tokens, more than the token budget of 25"
    ):
        plan_micro_batches([5, 20, 30, 26], max_sequences=4, max_tokens=25)


# ----------------------------------------------------------------------------- layout


def test_packed_layout_and_value_maps_round_trip():
    seqs = [[5, 6, 7], [8, 9], [1, 2, 3, 4], [3]]
    packed = PackedBatch.from_sequences(seqs, rows=[0, 1, 0, 1])
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4], [8, 9, 3, 0, 0, 0, 0]]
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, -1, -1, -1, -1]]
    assert packed.segments.tolist() == [[0, 0, 0, 2, 2, 2, 2], [1, 1, 3, -1, -1, -1, -1]]
    assert packed.num_tokens == 10
    ids, mask = right_padded(seqs)
    values = torch.arange(ids.shape[0] * (ids.shape[1] - 1), dtype=torch.float32).view(4, -1)
    values = torch.where(mask[:, 1:].bool(), values, 0.0)  # padded layout: 0 on padding
    back = packed.unpack_values(packed.pack_values(values, -1.0))
    live = mask[:, :-1].bool()
    assert torch.equal(back[live], values[live]) and not back[~live].any()


def test_left_padding_packs_the_same_tokens_as_right_padding():
    ids = torch.tensor([[0, 0, 4, 5, 6], [7, 8, 9, 1, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    packed = PackedBatch.from_padded(ids, mask)
    assert packed.input_ids.tolist() == [[4, 5, 6, 7, 8, 9, 1, 2]]
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


def test_bad_layout_inputs_raise():
    with pytest.raises(ValueError, match="one row >= 0 for each of the 2 sequences"):
        PackedBatch.from_sequences([[1, 2], [3]], rows=[0])
    with pytest.raises(ValueError, match="none of them empty"):
        PackedBatch.from_sequences([[1, 2], []])
    packed = PackedBatch.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"values must be \(S, T-1\)"):
        packed.pack_values(torch.zeros(1, 3), 0.0)
