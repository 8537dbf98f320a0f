"""The layout-free loss's per-sequence metric records: a non-finite token gives a non-finite
record (the step skipped with skip_reason 'non-finite loss', as the plain update's), never an
exception mid-step."""

from __future__ import annotations

import math

import torch

from rl_engine.executors.worker.layout_free.loss import sequence_records
from rl_engine.executors.worker.policy.step_loss import LossSums

INF = math.inf


def test_a_row_holding_plus_and_minus_inf_gives_a_non_finite_record():
    loss = torch.tensor([[INF, -INF, 1.0], [0.5, 0.25, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    records = sequence_records(LossSums, {"loss": loss, "tokens": mask.float()}, mask)
    bad, good = records.records
    assert math.isnan(bad.loss) and bad.tokens == 3.0
    assert good == LossSums(loss=0.75, tokens=2.0)  # the control: finite rows sum exactly
    assert not records.finite()
    assert not records.total().finite()
    plain = LossSums(loss=float(loss[mask].sum()), tokens=5.0)  # the plain update's sums
    assert not plain.finite()


def test_finite_rows_are_exact_sums_of_the_masked_tokens():
    loss = torch.tensor([[1e8, 1.0, -1e8, 7.0]], dtype=torch.float32)
    mask = torch.tensor([[True, True, True, False]])
    (record,) = sequence_records(LossSums, {"loss": loss, "kl": None}, mask).records
    assert record.loss == 1.0 and record.kl == 0.0
