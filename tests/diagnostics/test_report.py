"""Mismatch metrics and the diagnostics report on a real tiny model, invariance on and off."""

import json

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.diagnostics import first_mismatch, mismatch_metrics
from rl_engine.diagnostics.report import run_diagnosis


def test_metrics_are_exact_for_equal_inputs_and_count_mismatches():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    b = a.clone()
    b[1, 1] = -0.3
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    same = mismatch_metrics(a, a.clone(), mask)
    assert same.exact_match_fraction == 1.0 and same.max_abs_diff == 0.0 and same.k3_kl == 0.0
    m = mismatch_metrics(a, b, mask)
    assert m.num_tokens == 5 and m.exact_match_fraction == pytest.approx(4 / 5)
    assert m.max_abs_diff == pytest.approx(0.05, abs=1e-6) and m.k3_kl > 0
    assert first_mismatch(a, b, mask) == (1, 1, -0.25, pytest.approx(-0.3))
    assert first_mismatch(a, b, torch.tensor([[1, 1, 1], [1, 0, 1]])) is None
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch_metrics(a, b[:1])


def test_report_invariant_exact_plain_not(tmp_path):
    config = RunConfig.from_dict(
        {
            "model": "tiny-qwen3",
            "dtype": "bfloat16",
            "output_dir": str(tmp_path),
            "parity": "report",
            "rollout": {
                "prompts_per_step": 3,
                "samples_per_prompt": 2,
                "max_new_tokens": 8,
                "max_batch_size": 4,
            },
            "trainer": {"micro_batch_size": 4},
        }
    )
    report = run_diagnosis(config)
    invariant, plain = report.results
    assert invariant.batch_invariant and invariant.metrics.exact_match_fraction == 1.0
    assert invariant.first_divergence is None and all(m.equal for m in invariant.modules)
    assert not plain.batch_invariant and plain.metrics.exact_match_fraction < 1.0
    assert plain.first_divergence is not None
    out = tmp_path / "diagnosis"
    data = json.loads((out / "report.json").read_text())
    assert data["modes"]["batch_invariant=true"]["metrics"]["exact_match_fraction"] == 1.0
    assert "| true |" in (out / "report.md").read_text()
    assert (out / "mismatch.png").stat().st_size > 0
