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


def test_moe_report_routing_agreement_is_one_with_invariance(tmp_path):
    """Routing of every token in every sparse layer: engine forwards (continuous batching, KV
    cache, decode) == the trainer's recompute with invariance on; the plain run is reported."""
    config = RunConfig.from_dict(
        {
            "model": "tiny-mixtral",
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
    routing = invariant.routing
    assert [a.layer for a in routing.layers] == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    for layer in routing.layers:
        assert layer.tokens > 0
        assert layer.routing_agreement == layer.logits_equal == layer.experts_equal == 1.0
    assert routing.first_divergent_layer is None and routing.diverged_first is None
    assert plain.routing is not None and plain.routing.first_divergent_layer is not None
    assert plain.routing.diverged_first in ("router", "experts")
    assert all(0.0 <= a.routing_agreement <= 1.0 for a in plain.routing.layers)
    out = tmp_path / "diagnosis"
    data = json.loads((out / "report.json").read_text())
    layers = data["modes"]["batch_invariant=true"]["routing"]["layers"]
    assert [entry["routing_agreement"] for entry in layers] == [1.0, 1.0]
    text = (out / "report.md").read_text()
    assert "## Routing agreement" in text and "no sparse layer diverged" in text


def test_compare_routing_says_what_diverged_first():
    from rl_engine.diagnostics.routing import compare_routing
    from rl_engine.models import load_model

    model, _ = load_model("tiny-olmoe")
    layers = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]

    def seq(inputs=0.0, logits=0.0, experts=0.0, route=(0, 1, 2)):
        entry = (
            torch.full((4, 3), inputs),
            torch.full((4, 5), logits),
            torch.tensor([route] * 4),
            torch.full((4, 3), experts),
        )
        return {name: entry for name in layers}

    same = compare_routing(model, [seq()], [seq()])
    assert same.first_divergent_layer is None and same.min_agreement == 1.0
    experts = compare_routing(model, [seq()], [seq(experts=1.0)])
    assert (experts.first_divergent_layer, experts.diverged_first) == (layers[0], "experts")
    assert experts.input_equal and experts.tokens_experts_differ == 4
    router = compare_routing(model, [seq()], [seq(inputs=1.0, logits=1.0, route=(0, 2, 1))])
    assert router.diverged_first == "router" and not router.input_equal
    assert router.layers[0].routing_agreement == 0.0 and router.tokens_router_differs == 4
