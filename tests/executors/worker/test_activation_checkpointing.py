"""trainer.activation_checkpointing on a DeepSpeedTrainingWorker in this process (1 rank, real
DeepSpeed on the CPU accelerator, the patched invariant model): each decoder layer recomputes
its forward in the backward, which runs the same invariant ops on the same inputs, so a step
with it is bit for bit the step without it (metrics, loss and grad_norm included, weights
torch.equal), in fp32 and bf16, at ZeRO-0 and ZeRO-3, with trainer.layout_invariant and with a
LoRA policy; the PPO critic's backbone likewise.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.worker.critic.worker import CriticWorker
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from tests.helpers.worker.cell import cached_completions, cell_config, to_batch
from tests.helpers.worker.critic_setup import critic_config, gae_returns

CELLS = [(0, "float32"), (3, "float32"), (0, "bfloat16"), (3, "bfloat16")]


def _worker(
    stage: int, dtype: str, checkpointing: bool, lora: dict | None = None, **trainer
) -> DeepSpeedTrainingWorker:
    trainer = {**trainer, "activation_checkpointing": checkpointing}
    data = cell_config(stage, 1, dtype, trainer=trainer).to_dict()
    if lora is not None:
        data["lora"] = lora
    return DeepSpeedTrainingWorker(RunConfig.from_dict(data), device="cpu")


def _step(stage: int, dtype: str, checkpointing: bool, **options):
    """(metrics but time/*, exported weights, forwards of the first layer's MLP) of one step."""
    worker = _worker(stage, dtype, checkpointing, **options)
    layers = worker.module.policy.model.layers
    assert all(layer.gradient_checkpointing is checkpointing for layer in layers)
    forwards = []
    # a pre-hook: the recompute stops once it has every saved tensor (torch's early stop),
    # inside the MLP, so the MLP's forward hook would not see it
    layers[0].mlp.register_forward_pre_hook(lambda *_: forwards.append(1))
    metrics = worker.train_step(to_batch(cached_completions(dtype)))
    metrics = {k: v for k, v in metrics.items() if not k.startswith("time/")}
    return metrics, worker.export_weights(), len(forwards)


def _same_step(on, off) -> None:
    """The steps agree bit for bit, and the one with checkpointing recomputed its layers."""
    (metrics_a, weights_a, forwards_on), (metrics_b, weights_b, forwards_off) = on, off
    assert forwards_on == 2 * forwards_off > 0  # every training forward recomputed
    assert metrics_a == metrics_b
    assert metrics_a["updates"] == 1 and metrics_a["skipped_update"] == 0
    assert metrics_a["loss"] != 0.0 and metrics_a["grad_norm"] > 0.0  # a real step was compared
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.parametrize("stage,dtype", CELLS)
def test_a_step_with_activation_checkpointing_is_the_step_without(stage, dtype):
    _same_step(_step(stage, dtype, True), _step(stage, dtype, False))


def test_layout_invariant_step_with_activation_checkpointing_is_the_step_without():
    on = _step(3, "bfloat16", True, layout_invariant=True)
    _same_step(on, _step(3, "bfloat16", False, layout_invariant=True))


def test_a_lora_step_with_activation_checkpointing_is_the_step_without():
    lora = {"rank": 4, "alpha": 8}
    _same_step(_step(3, "bfloat16", True, lora=lora), _step(3, "bfloat16", False, lora=lora))


def test_the_key_is_off_by_default_and_checked():
    config = cell_config(0, 1, "float32")
    assert config.trainer.activation_checkpointing is False
    data = {"model": "tiny-llama", "trainer": {"activation_checkpointing": 1}}
    with pytest.raises(ValueError, match="trainer.activation_checkpointing"):
        RunConfig.from_dict(data)


def _critic_step(checkpointing: bool):
    """(metrics but time/*, values after the update, forwards of the first layer's MLP)."""
    critic = CriticWorker(critic_config({"activation_checkpointing": checkpointing}), device="cpu")
    layers = critic.module.backbone.layers
    assert all(layer.gradient_checkpointing is checkpointing for layer in layers)
    batch = to_batch(cached_completions("float32"))
    values = critic.values(batch)
    forwards = []
    layers[0].mlp.register_forward_pre_hook(lambda *_: forwards.append(1))
    metrics = critic.train_step(batch, gae_returns(batch, values), values)
    metrics = {k: v for k, v in metrics.items() if not k.startswith("time/")}
    return metrics, critic.values(batch), len(forwards)


def test_the_critics_step_with_activation_checkpointing_is_the_step_without():
    (metrics_on, values_on, forwards_on) = _critic_step(True)
    (metrics_off, values_off, forwards_off) = _critic_step(False)
    assert forwards_on > forwards_off > 0  # its training forwards recomputed (no-grad ones not)
    assert metrics_on == metrics_off
    assert torch.equal(values_on, values_off)
