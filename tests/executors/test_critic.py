"""The PPO critic's DeepSpeed worker (one rank, ZeRO-0): invariant values, updates, checkpoints.

Equality chain of the invariance test: the values of a sequence computed in packed
micro-batches of 4 == in padded micro-batches of 1 == under a token budget == inside a
different batch mix (other sequences, reversed order), all with `torch.equal`. The
negative control: the same backbone unpatched gives other bits for two of those layouts.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.algorithms import compute_advantages
from rl_engine.config import RunConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.critic import CriticWorker
from rl_engine.executors.worker.deepspeed_trainer import DeepSpeedTrainingWorker
from rl_engine.executors.worker.errors import BatchError
from tests.executors.cell import cached_completions, cell_config, to_batch


def _config(**trainer) -> RunConfig:
    data = cell_config(0, 1, "float32", algorithm={"name": "ppo", "kl_coef": 0.0}).to_dict()
    data["trainer"].update(trainer)
    data["critic"] = {"lr": 1e-3, "value_clip": 0.2}
    if data["trainer"].get("batch_invariant") is not None:
        data["batch_invariant"] = data["trainer"].pop("batch_invariant")
        data["parity"] = "off"
    return RunConfig.from_dict(data)


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return to_batch(cached_completions("float32"))


def _gae(batch: TrainBatch, values: torch.Tensor) -> torch.Tensor:
    groups = torch.arange(batch.num_sequences) // 4
    return compute_advantages("gae", batch.rewards, groups, mask=batch.response_mask, values=values)


def _trained(worker: CriticWorker, batch: TrainBatch) -> torch.Tensor:
    """Values that are not zero everywhere: the head starts at 0, one update moves it."""
    values = worker.values(batch)
    worker.train_step(batch, _gae(batch, values) + values, values)
    return worker.values(batch)


def test_values_do_not_depend_on_layout_packing_or_batch_mix(batch):
    packed4 = CriticWorker(_config(micro_batch_size=4, packing=True), device="cpu")
    reference = _trained(packed4, batch)
    assert bool((reference[batch.response_mask] != 0).all())
    assert bool((reference[~batch.response_mask] == 0).all())
    state = {k: v.clone() for k, v in packed4.module.state_dict().items()}
    for layout in (
        {"micro_batch_size": 1, "packing": False},
        {"micro_batch_size": 3, "packing": True, "max_tokens_per_micro_batch": 24},
    ):
        other = CriticWorker(_config(**layout), device="cpu")
        other.module.load_state_dict(state)
        assert torch.equal(other.values(batch), reference), layout
    mix = batch._index(torch.tensor([7, 2, 5]))  # other neighbours, another width
    values = packed4.values(mix)
    width = values.shape[1]
    assert torch.equal(values, reference[[7, 2, 5], :width])


def test_unpatched_backbone_values_depend_on_the_layout(batch):
    plain = [
        CriticWorker(_config(batch_invariant=False, **layout), device="cpu")
        for layout in ({"micro_batch_size": 4, "packing": True}, {"micro_batch_size": 1})
    ]
    values = _trained(plain[0], batch)
    plain[1].module.load_state_dict(plain[0].module.state_dict())
    assert not torch.equal(plain[1].values(batch), values)


def test_updates_move_values_to_the_returns_and_a_checkpoint_resumes_bitwise(batch, tmp_path):
    worker = CriticWorker(_config(), device="cpu")
    old = worker.values(batch)
    returns = _gae(batch, old) + old
    mask = batch.response_mask
    first = worker.train_step(batch, returns, old)
    assert first["critic/updates"] == 1 and first["critic/skipped_update"] == 0
    worker.save_checkpoint(tmp_path / "critic")
    moved = worker.values(batch)
    error_before = (old - returns)[mask].square().mean()
    assert (moved - returns)[mask].square().mean() < error_before
    second = worker.train_step(batch, returns, moved)
    after = worker.values(batch)
    resumed = CriticWorker(_config(), device="cpu")
    resumed.load_checkpoint(tmp_path / "critic")
    assert torch.equal(resumed.values(batch), moved)
    assert resumed.train_step(batch, returns, moved) == second
    assert torch.equal(resumed.values(batch), after)
    assert first["critic/value_loss"] > second["critic/value_loss"] > 0
    with pytest.raises(BatchError, match=r"returns must be \(B, T-1\)"):
        worker.train_step(batch, returns[:, :3], moved)


def test_a_warmup_step_checks_parity_and_leaves_the_policy_as_it_was(batch):
    """critic.warmup_steps: the policy worker's step without an update (strict parity holds)."""
    policy = DeepSpeedTrainingWorker(_config(), device="cpu")
    before = {k: v.clone() for k, v in policy.module.state_dict().items()}
    metrics = policy.train_step(batch, update=False)
    assert metrics["updates"] == 0 and metrics["weight_version"] == 0
    assert metrics["parity/exact_match_fraction"] == 1.0
    assert metrics["parity/num_tokens"] == batch.num_tokens == metrics["tokens"]
    after = policy.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert policy.train_step(batch)["weight_version"] == 1  # then a real update, still on-policy
