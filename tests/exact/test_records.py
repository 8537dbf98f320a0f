"""rl_engine.exact.records: named sums merge field by field and cross the ranks' collective as one tensor.

The records that carry the step's metrics (`ParitySums`, `CorrectionSums`, the worker's
`LossSums`) are checked here for what the collectives rely on: the packed layout is the
declaration order, a record all-reduces in one 'sum' of its whole tensor plus one 'max' of
its max fields only, and the result over ranks equals merging the ranks' records.
"""

import math

import pytest
import torch

from rl_engine.exact.records import SequenceRecords
from rl_engine.executors.worker.policy.step_loss import LossSums
from rl_engine.logprobs.parity import CorrectionSums, ParitySums, parity_sums


def _ranks_all_reduce(records: list, max_positions: list[int], calls: list):
    """`all_reduce(tensor, op)` as rank 0 of `len(records)` ranks sees it: 'sum' reduces the
    ranks' packed records, 'max' the entries at `max_positions` of them (the layout the
    records must keep). Each call is logged in `calls` as (op, number of entries)."""
    packed = torch.stack([r.pack() for r in records])

    def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        calls.append((op, tensor.numel()))
        if op == "sum":
            assert torch.equal(tensor, packed[0])
            return packed.sum(0)
        assert torch.equal(tensor, packed[0, max_positions])
        return packed[:, max_positions].max(0).values

    return all_reduce


def test_merge_adds_the_sums_and_maxes_the_max_fields():
    a = ParitySums(exact=3, tokens=4, abs_sum=0.5, abs_max=0.25, k3_sum=0.1, prob_abs_sum=0.2)
    b = ParitySums(exact=1, tokens=2, abs_sum=0.25, abs_max=0.125, k3_sum=0.3, prob_abs_sum=0.1)
    merged = a.merge(b)
    assert merged == ParitySums(
        exact=4, tokens=6, abs_sum=0.75, abs_max=0.25, k3_sum=0.1 + 0.3, prob_abs_sum=0.2 + 0.1
    )
    assert merged.mismatches == 2
    assert ParitySums().merge(a) == a  # the defaults are each field's identity
    assert (
        CorrectionSums().merge(CorrectionSums(ratio_max=0.5, neg_ratio_min=-2.0)).ratio_max == 0.5
    )
    assert CorrectionSums().ratio_max == -math.inf  # a max starts below every ratio
    # a NaN part shows in the total, as torch.maximum would show it
    assert math.isnan(a.merge(ParitySums(abs_max=math.nan)).abs_max)
    assert math.isnan(ParitySums(abs_max=math.nan).merge(a).abs_max)
    with pytest.raises(TypeError, match="cannot merge LossSums into ParitySums"):
        a.merge(LossSums())


def test_pack_is_the_declaration_order_and_unpack_its_inverse():
    record = ParitySums(exact=1, tokens=2, abs_sum=3, abs_max=4, k3_sum=5, prob_abs_sum=6)
    packed = record.pack()
    assert packed.dtype == torch.float64 and packed.device.type == "cpu"
    assert packed.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert ParitySums.unpack(packed) == record
    with pytest.raises(ValueError, match=r"ParitySums packs 6 values \(exact, tokens, .*got 5"):
        ParitySums.unpack(packed[:5])


def test_all_reduce_is_one_sum_of_the_record_and_one_max_of_its_max_fields():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]])
    rollout = trainer.clone()
    rollout[0, 1], rollout[1, 2] = -2.5, -3.0
    ranks = [parity_sums(trainer[r : r + 1], rollout[r : r + 1]) for r in range(2)]
    calls = []
    total = ranks[0].all_reduce(_ranks_all_reduce(ranks, [3], calls))
    assert calls == [("sum", 6), ("max", 1)]
    assert total == ranks[0].merge(ranks[1]) == parity_sums(trainer, rollout)
    assert total.abs_max == 1.0 and total.abs_sum == 1.5  # the max is not a sum of maxes

    calls.clear()
    parts = [CorrectionSums(tokens=3, ratio_max=2.0, neg_ratio_min=-0.5), CorrectionSums(tokens=1)]
    total = parts[0].all_reduce(_ranks_all_reduce(parts, [4, 5], calls))
    assert calls == [("sum", 11), ("max", 2)] and total == parts[0].merge(parts[1])

    calls.clear()
    parts = [LossSums(loss=0.5, tokens=3), LossSums(loss=0.25, tokens=4)]
    total = parts[0].all_reduce(_ranks_all_reduce(parts, [], calls))
    assert calls == [("sum", 6)] and total == LossSums(loss=0.75, tokens=7)


def test_finite_sees_every_field():
    assert LossSums(loss=1.0, tokens=2).finite()
    assert not LossSums(loss=math.inf, tokens=2).finite()
    assert not LossSums(kl=math.nan).finite()


def test_from_tensors_keeps_each_value_exactly_and_defaults_the_rest():
    loss, tokens = torch.tensor(0.1, dtype=torch.float32), torch.tensor([1, 1, 0]).sum()
    record = LossSums.from_tensors(loss=loss, tokens=tokens)
    assert record == LossSums(loss=float(loss), tokens=2.0)  # the fp32 value, not 0.1
    assert record.loss != 0.1


def test_sequence_records_total_exactly_in_any_order_and_max_their_max_fields():
    """SequenceRecords: each sum field's total is the exact sum of the sequences' values, so a
    shuffled or regrouped set of records gives the same bits; a float sum in order does not."""
    values = [1e16, 1.0, -1e16, 1.0, 0.1]
    records = [
        ParitySums(
            exact=1, tokens=1, abs_sum=v, abs_max=abs(v) / 1e16, k3_sum=0.0, prob_abs_sum=0.0
        )
        for v in values
    ]
    forward = SequenceRecords(ParitySums, tuple(records)).total()
    regrouped = (
        SequenceRecords(ParitySums, tuple(records[3:]))
        .merge(SequenceRecords(ParitySums, tuple(reversed(records[:3]))))
        .total()
    )
    assert forward == regrouped and forward.abs_sum == math.fsum(values) == 2.1
    assert forward.abs_max == 1.0 and forward.exact == 5
    assert sum(values) != 2.1  # the negative control: float adds in order lose the ones
    with pytest.raises(TypeError, match="cannot merge LossSums records into ParitySums records"):
        SequenceRecords(ParitySums).merge(SequenceRecords(LossSums))
