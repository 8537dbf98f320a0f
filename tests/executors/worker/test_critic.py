"""The PPO critic's DeepSpeed worker (one rank, ZeRO-0): invariant values, updates, checkpoints.

Equality chain of the invariance test: the values of a sequence computed in packed
micro-batches of 4 == in padded micro-batches of 1 == under a token budget == inside a
different batch mix (other sequences, reversed order), all with `torch.equal`. The
negative control: the same backbone unpatched gives other bits for two of those layouts.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.critic.worker import CriticWorker
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.executors.worker.errors import BatchError
from rl_engine.executors.worker.policy.setup import load_policy
from rl_engine.patching.lora import base_fingerprint, is_adapter_name
from tests.helpers.worker.cell import cached_completions, to_batch
from tests.helpers.worker.critic_setup import critic_config, gae_returns


def _config(**trainer):
    if "batch_invariant" in trainer:  # the negative control: unpatched, no parity check
        flag = trainer.pop("batch_invariant")
        return critic_config(trainer, batch_invariant=flag, parity="off")
    return critic_config(trainer)


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return to_batch(cached_completions("float32"))


def _trained(worker: CriticWorker, batch: TrainBatch) -> torch.Tensor:
    """Values that are not zero everywhere: the head starts at 0, one update moves it."""
    values = worker.values(batch)
    worker.train_step(batch, gae_returns(batch, values), values)
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
    returns = gae_returns(batch, old)
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


def test_a_lora_critic_trains_its_own_adapter_and_head_on_the_frozen_base(batch, tmp_path):
    """lora.rank > 0: the critic's backbone is the policy's base, frozen (no gradient, not in
    the optimizer), with an adapter of its own (another A than the policy's); one update on
    V = 0 moves the head, the next the adapter too; a checkpoint resumes bitwise, and one of
    another base is refused."""
    config = critic_config(lora={"rank": 4, "alpha": 8})
    worker = CriticWorker(config, device="cpu")
    named = dict(worker.module.named_parameters())
    adapters = {n for n in named if is_adapter_name(n)}
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert adapters and trainable == adapters | {"head.weight", "head.bias"}
    held = {id(p) for group in worker.guard.optimizer.param_groups for p in group["params"]}
    assert held == {id(named[n]) for n in trainable}
    policy, _ = load_policy(config)  # the policy's adapter, drawn from config.seed
    assert worker.base == {"model": config.model, "hash": base_fingerprint(policy)}
    a_name = next(n for n in adapters if ".lora_A." in n)
    policy_a = policy.get_parameter("model." + a_name.removeprefix("backbone."))
    assert not torch.equal(named[a_name], policy_a)  # its own seed stream
    before = {n: p.detach().clone() for n, p in named.items()}

    old = worker.values(batch)
    returns = gae_returns(batch, old)
    worker.train_step(batch, returns, old)  # the head starts at 0: only it moves
    worker.save_checkpoint(tmp_path / "critic")
    moved = worker.values(batch)
    second = worker.train_step(batch, returns, moved)
    after = worker.values(batch)
    changed = {n for n, p in named.items() if not torch.equal(p, before[n])}
    assert {n for n in adapters if ".lora_B." in n} <= changed  # B starts at 0, now moved
    assert changed <= trainable  # the base is untouched

    resumed = CriticWorker(config, device="cpu")
    resumed.load_checkpoint(tmp_path / "critic")
    assert torch.equal(resumed.values(batch), moved)
    assert resumed.train_step(batch, returns, moved) == second
    assert torch.equal(resumed.values(batch), after)
    other_base = CriticWorker(critic_config(lora={"rank": 4, "alpha": 8}, seed=4), device="cpu")
    with pytest.raises(ValueError, match="holds adapters of base 'tiny-llama'"):
        other_base.load_checkpoint(tmp_path / "critic")


def test_a_warmup_step_checks_parity_and_leaves_the_policy_as_it_was(batch):
    """critic.warmup_steps: the policy worker's step without an update (strict parity holds)."""
    policy = DeepSpeedTrainingWorker(_config(mini_batch_size=4, epochs=2), device="cpu")
    before = {k: v.clone() for k, v in policy.module.state_dict().items()}
    metrics = policy.train_step(batch, update=False)
    assert metrics["updates"] == 0 and metrics["weight_version"] == 0
    assert metrics["parity/exact_match_fraction"] == 1.0
    assert metrics["parity/num_tokens"] == batch.num_tokens == metrics["tokens"]
    after = policy.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert policy.train_step(batch)["weight_version"] == 4  # then 2 x 2 updates, on-policy


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_zero3_values_equal_one_ranks_and_resume(batch, tmp_path):
    """Two critic ranks under ZeRO-3: after one update both ranks hold the same critic, whose
    values of the batch (partitioned parameters, each rank all rows) == one ZeRO-0 rank's with
    the gathered weights; a checkpoint restores it; shard values before it == one rank's."""
    from tests.helpers.worker.launch import run_ranks

    path = tmp_path / "completions.pt"
    torch.save(cached_completions("float32"), path)
    spec = {"job": "tests.helpers.worker.critic_ranks_job", "completions": {"float32": str(path)}}
    ranks, error = run_ranks(spec, 2, tmp_path, timeout=300)
    assert error is None, error
    results = [r["critic_ranks_job"] for r in ranks]
    assert all(r["zero_stage"] == 3 for r in results)
    one_rank = CriticWorker(_config(), device="cpu")
    assert torch.equal(torch.cat([r["shard_values"] for r in results]), one_rank.values(batch))
    one_rank.module.load_state_dict(results[0]["state"])  # the trained critic, gathered
    assert torch.equal(one_rank.values(batch), results[0]["after"])
    assert results[0]["metrics"] == results[1]["metrics"]  # all-reduced
    assert results[0]["metrics"]["critic/skipped_update"] == 0
    assert torch.equal(results[0]["after"], results[1]["after"])
    assert bool((results[0]["after"][batch.response_mask] != 0).all())
    assert all(torch.equal(r["resumed"], r["after"]) for r in results)
