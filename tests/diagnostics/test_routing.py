"""Routing agreement (rl_engine/diagnostics/routing.py) on hand-made per-token routing of a real
tiny MoE model's sparse layers: identical routing agrees everywhere (the negative control of
the two below); a router logit changed at one token makes that layer the first divergent one,
'router' first; the same logits with another experts output say 'experts'; trainer rows are
cut to the rollout's; the engine trace refuses forwards that are not an engine's."""

from __future__ import annotations

import pytest
import torch

from rl_engine.diagnostics.routing import EngineRoutingTrace, RoutingReport, compare_routing
from rl_engine.models import load_model
from rl_engine.patching import moe_layers

TOKENS, HIDDEN, EXPERTS, TOP_K = 5, 4, 6, 2
# one token of TOKENS off, as the report's fp32 mean of a bool per token gives it
ONE_OFF = float(torch.tensor(1 - 1 / TOKENS, dtype=torch.float32))


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen2-moe")[0]


def routing(layers: list[str], seed: int, tokens: int = TOKENS) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        logits = torch.randn(tokens, EXPERTS, generator=g)
        indices = logits.topk(TOP_K, dim=-1).indices
        out[layer] = (
            torch.randn(tokens, HIDDEN, generator=g),
            logits,
            indices,
            torch.randn(tokens, HIDDEN, generator=g),
        )
    return out


def copy(seq: dict) -> dict:
    return {layer: tuple(t.clone() for t in parts) for layer, parts in seq.items()}


def test_identical_routing_agrees_on_every_layer(model):
    layers = moe_layers(model)
    rollout = [routing(layers, seed) for seed in range(2)]
    report = compare_routing(model, rollout, [copy(s) for s in rollout])
    assert [a.layer for a in report.layers] == layers and len(layers) == 2
    assert all(
        (a.tokens, a.routing_agreement, a.logits_equal, a.experts_equal)
        == (2 * TOKENS, 1.0, 1.0, 1.0)
        for a in report.layers
    )
    assert (report.first_divergent_layer, report.diverged_first, report.min_agreement) == (
        None,
        None,
        1.0,
    )


def test_a_changed_logit_is_a_router_divergence_in_its_layer(model):
    layers = moe_layers(model)
    rollout = [routing(layers, 0)]
    trainer = [copy(rollout[0])]
    _, logits, indices, _ = trainer[0][layers[1]]
    logits[2, indices[2, 0]] -= 100.0  # the top expert falls out of token 2's top-k
    trainer[0][layers[1]] = (
        *trainer[0][layers[1]][:2],
        logits.topk(TOP_K, dim=-1).indices,
        trainer[0][layers[1]][3],
    )
    report = compare_routing(model, rollout, trainer)
    assert report.layers[0].routing_agreement == 1.0
    assert report.layers[1].routing_agreement == report.layers[1].logits_equal == ONE_OFF
    assert (report.first_divergent_layer, report.diverged_first) == (layers[1], "router")
    assert (report.input_equal, report.tokens_router_differs, report.tokens_experts_differ) == (
        True,
        1,
        0,
    )
    assert report.min_agreement == ONE_OFF


def test_the_same_logits_with_another_experts_output_is_an_experts_divergence(model):
    layers = moe_layers(model)
    rollout = [routing(layers, 0)]
    trainer = [copy(rollout[0])]
    trainer[0][layers[0]][3][4, 0] += 1.0
    trainer[0][layers[0]][0][1, 1] += 1.0  # another router input, the same logits
    report = compare_routing(model, rollout, trainer)
    assert (report.first_divergent_layer, report.diverged_first) == (layers[0], "experts")
    assert (report.input_equal, report.tokens_router_differs, report.tokens_experts_differ) == (
        False,
        0,
        1,
    )
    assert report.layers[0].experts_equal == ONE_OFF and report.layers[0].routing_agreement == 1.0


def test_trainer_rows_are_cut_to_the_rollouts(model):
    """The rollout never feeds the last sampled token; the trainer's recompute has it."""
    layers = moe_layers(model)
    trainer = routing(layers, 0, tokens=TOKENS + 1)
    rollout = {layer: tuple(t[:TOKENS].clone() for t in parts) for layer, parts in trainer.items()}
    report = compare_routing(model, [rollout], [trainer])
    assert report.first_divergent_layer is None and report.layers[0].tokens == TOKENS
    with pytest.raises(ValueError):  # a completion missing on one side is an error, not a skip
        compare_routing(model, [rollout], [trainer, trainer])


def test_a_report_without_layers_agrees():
    assert RoutingReport([]).min_agreement == 1.0


def test_the_engine_trace_refuses_a_forward_without_the_engines_cache(model):
    with pytest.raises(RuntimeError, match="records RolloutEngine forwards only"):
        with EngineRoutingTrace(model), torch.no_grad():
            model(torch.tensor([[3, 4, 5]]))
