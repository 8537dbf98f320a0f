"""The sequence-wise balance loss's metric records: non-finite router values give a
non-finite record, never an exception mid-step."""

from __future__ import annotations

import math

import torch

from rl_engine.executors.worker.layout_free.router_balance import AuxSums, sequence_aux_records
from rl_engine.kernels import SequenceSpans

INF = math.inf


def test_layers_summing_to_plus_and_minus_inf_give_a_non_finite_record():
    spans = SequenceSpans(3, (0, 2), (2, 1), (0, 1))
    unit = torch.ones(3, 2, dtype=torch.float64)
    first = torch.tensor([[INF, 0.0], [0.25, 0.25], [0.5, 0.5]])
    second = torch.tensor([[-INF, 0.0], [0.25, 0.25], [0.5, 0.5]])
    records = sequence_aux_records([first, second], unit, spans)
    bad, good = records.records
    assert math.isnan(bad.aux_loss)
    assert good == AuxSums(2.0)  # the control: a finite sequence's exact sum
    assert not records.finite()
