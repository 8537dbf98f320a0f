"""Picking an algorithm: the config keys, the batch's advantages, and the worker's loss.

`algorithm.advantage` (the estimator the job's TrainBatch is built with), `algorithm.ratio_level`
(GSPO's sequence ratio in the worker's loss), and the errors that name their key.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from rl_engine.algorithms import compute_advantages
from rl_engine.config import RunConfig
from rl_engine.executors import BatchError
from rl_engine.executors.worker.batch import TrainBatch
from tests.helpers.worker.completions import completion, two_groups

# ------------------------------------------------------------------ config


def test_advantage_defaults_to_grpo_and_today_is_unchanged():
    config = RunConfig()
    assert config.algorithm.name == "grpo" and config.algorithm.advantage == "grpo"
    assert config.algorithm.ratio_level == "token"
    assert config.trainer.mini_batch_size == 0 and config.trainer.epochs == 1
    assert config.trainer.parity_scope == "all" and config.mini_batches_per_step == 1


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_each_critic_free_estimator_is_accepted(name):
    assert RunConfig.from_dict({"algorithm": {"advantage": name}}).algorithm.advantage == name


INVALID = [
    ({"algorithm": {"advantage": "vtrace"}}, "algorithm.advantage must be one of"),
    ({"algorithm": {"advantage": "gae"}}, "algorithm.advantage 'gae' needs a critic"),
    ({"algorithm": {"ratio_level": "tokens"}}, "algorithm.ratio_level must be one of"),
    ({"algorithm": {"gamma": 1.5}}, "algorithm.gamma must be"),
    ({"algorithm": {"lam": -0.1}}, "algorithm.lam must be"),
    ({"trainer": {"mini_batch_size": -1}}, "trainer.mini_batch_size must be"),
    ({"trainer": {"epochs": 0}}, "trainer.epochs must be"),
    ({"trainer": {"parity_scope": "none"}}, "trainer.parity_scope must be one of"),
]


@pytest.mark.parametrize(("data", "message"), INVALID, ids=[m for _, m in INVALID])
def test_bad_algorithm_keys_name_themselves(data, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        RunConfig.from_dict(data)


def test_mini_batch_size_must_split_the_step():
    step = {"rollout": {"prompts_per_step": 4, "samples_per_prompt": 4}}  # 16 sequences
    ok = RunConfig.from_dict({**step, "trainer": {"mini_batch_size": 8, "micro_batch_size": 2}})
    assert ok.mini_batches_per_step == 2 and ok.mini_batch_per_rank == 8
    assert ok.gradient_accumulation_steps == 4  # per optimizer step, not per RL step
    for trainer, message in [
        ({"mini_batch_size": 6}, "trainer.mini_batch_size = 6 must divide"),
        ({"mini_batch_size": 32}, "trainer.mini_batch_size = 32 must divide"),
        (
            {"mini_batch_size": 4, "num_ranks": 8, "micro_batch_size": 1},
            "multiple of trainer.num_ranks",
        ),
        ({"mini_batch_size": 4, "micro_batch_size": 8}, "multiple of trainer.micro_batch_size"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            RunConfig.from_dict({**step, "trainer": trainer})
    budget = {"mini_batch_size": 4, "micro_batch_size": 8, "max_tokens_per_micro_batch": 64}
    assert RunConfig.from_dict({**step, "trainer": budget}).gradient_accumulation_steps == 1


# ------------------------------------------------------------------ the batch's advantages


def _whiten(values):
    flat = torch.tensor(values, dtype=torch.float64)
    mean, var = flat.mean().item(), flat.var(correction=1).item()
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_batch_advantages_follow_the_estimator():
    comps, rewards = two_groups()  # groups (1, 0) and (0.5, 2); 2, 4, 1, 3 completion tokens
    rloo = TrainBatch.from_completions(comps, rewards, pad_token_id=0, advantage="rloo")
    assert torch.equal(rloo.advantages, torch.tensor([1.0, -1.0, -1.5, 1.5]))  # r - other's r
    per_token = TrainBatch.from_completions(
        comps, rewards, pad_token_id=0, advantage="reinforce_pp"
    )
    mask = per_token.response_mask
    assert per_token.advantages.shape == mask.shape  # (B, T-1), aligned with response_mask
    assert torch.equal(per_token.advantages[~mask], torch.zeros(int((~mask).sum())))
    # gamma 1: every completion token carries its sequence's reward, whitened over the batch
    tokens = [1.0] * 2 + [0.0] * 4 + [0.5] + [2.0] * 3
    expected = torch.tensor(_whiten(tokens), dtype=torch.float32)
    torch.testing.assert_close(per_token.advantages[mask], expected)
    baseline = TrainBatch.from_completions(
        comps, rewards, pad_token_id=0, advantage="reinforce_pp_baseline"
    )
    tokens = [0.5] * 2 + [-0.5] * 4 + [-0.75] + [0.75] * 3  # r - mean of its group
    torch.testing.assert_close(baseline.advantages[mask], torch.tensor(_whiten(tokens)).float())


def test_batch_uses_compute_advantages_exactly():
    comps, rewards = two_groups()
    comps = [comps[0], comps[2], comps[1], comps[3]]  # groups interleaved
    rewards = [rewards[0], rewards[2], rewards[1], rewards[3]]
    for name in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        batch = TrainBatch.from_completions(comps, rewards, pad_token_id=0, advantage=name)
        mask = None if name in ("grpo", "rloo") else batch.response_mask
        expected = compute_advantages(
            name, torch.tensor(rewards), torch.tensor([0, 1, 0, 1]), mask=mask
        )
        assert torch.equal(batch.advantages, expected)


def test_per_token_advantages_travel_with_their_tokens():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, pad_token_id=0, advantage="reinforce_pp")
    shard = batch.shard(1, 2)
    assert torch.equal(shard.advantages, batch.advantages[2:])
    narrow = batch._columns(4)  # the packing / token-budget trim keeps advantages aligned
    assert narrow.advantages.shape == narrow.response_mask.shape == (4, 3)
    assert torch.equal(narrow.advantages, batch.advantages[:, :3])
    with pytest.raises(BatchError, match=r"advantages must have shape \(4,\) or \(4, 6\)"):
        TrainBatch(**{**_fields(batch), "advantages": torch.zeros(4, 7)})


def _fields(batch):
    return {
        name: getattr(batch, name)
        for name in (
            "input_ids",
            "attention_mask",
            "response_mask",
            "rollout_logprobs",
            "advantages",
            "rewards",
        )
    }


def test_unknown_group_sizes_still_raise():
    comps = [completion([1], [2]), completion([1], [3]), completion([4], [5], index=1)]
    with pytest.raises(BatchError, match="samples_per_prompt=2"):
        TrainBatch.from_completions(comps, [1.0, 0.0, 1.0], pad_token_id=0, advantage="rloo")


# ------------------------------------------------------------------ the worker's loss


@pytest.fixture(scope="module")
def cell_batch():
    from tests.helpers.worker.cell import cached_completions, to_batch

    return to_batch(cached_completions("float32"))


def _worker(**overrides):
    from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
    from tests.helpers.worker.cell import cell_config

    algorithm = {"kl_coef": 0.0, **overrides.pop("algorithm", {})}
    return DeepSpeedTrainingWorker(
        cell_config(0, 1, "float32", algorithm=algorithm, **overrides), device="cpu"
    )


def test_per_token_advantages_train_like_their_broadcast(cell_batch):
    """A (B,) advantage and the same numbers per token, (B, T-1), take the same step bitwise."""
    import dataclasses

    mask = cell_batch.response_mask
    per_token = dataclasses.replace(
        cell_batch, advantages=torch.where(mask, cell_batch.advantages[:, None], 0.0)
    )
    a, b = _worker(), _worker()
    ma, mb = a.train_step(cell_batch), b.train_step(per_token)
    assert ma["policy_loss"] == mb["policy_loss"] and ma["grad_norm"] == mb["grad_norm"]
    wa, wb = a.export_weights(), b.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the negative control: other per-token numbers move the weights differently
    c = _worker()
    shifted = dataclasses.replace(per_token, advantages=per_token.advantages * 0.5)
    c.train_step(shifted)
    assert not all(torch.equal(wa[k], v) for k, v in c.export_weights().items())


def test_sequence_ratio_level_is_gspo_in_the_worker(cell_batch):
    """ratio_level 'sequence': the step's loss is GSPO's on the trainer's logprobs vs old ones."""
    import dataclasses

    from rl_engine.algorithms import policy_loss

    mask = cell_batch.response_mask
    gen = torch.Generator().manual_seed(1)
    old = cell_batch.rollout_logprobs + torch.where(
        mask, 0.3 * torch.randn(mask.shape, generator=gen), 0.0
    )
    off_policy = dataclasses.replace(cell_batch, rollout_logprobs=old)
    aggregation = "seq-mean-token-mean"
    worker = _worker(
        parity="report", algorithm={"ratio_level": "sequence", "loss_aggregation": aggregation}
    )
    logp = worker.compute_logprobs(off_policy)
    metrics = worker.train_step(off_policy)
    expected = {
        level: float(
            policy_loss(
                logp, old, off_policy.advantages, mask, aggregation=aggregation, ratio_level=level
            )[0]
        )
        for level in ("sequence", "token")
    }
    assert metrics["policy_loss"] == pytest.approx(expected["sequence"], rel=1e-5, abs=1e-7)
    assert abs(expected["sequence"] - expected["token"]) > 1e-3  # the levels differ here


def test_shards_of_mini_batches_are_the_ranks_rows_of_each():
    """Mini-batch j is rows [j M, (j + 1) M) of the step whatever the world size."""
    import dataclasses

    comps, rewards = two_groups()
    more = [dataclasses.replace(c, prompt_index=c.prompt_index + 2) for c in comps]
    comps, rewards = comps + more, rewards + [3.0, 1.0, 0.0, 0.0]
    batch = TrainBatch.from_completions(comps, rewards, pad_token_id=0, advantage="reinforce_pp")
    rows = {r: batch.shard(r, 2, mini_batches=2) for r in (0, 1)}
    for rank, expected in ((0, [0, 1, 4, 5]), (1, [2, 3, 6, 7])):
        assert torch.equal(rows[rank].rewards, batch.rewards[expected])
        assert torch.equal(rows[rank].advantages, batch.advantages[expected])
    assert torch.equal(batch.shard(1, 2, mini_batches=1).rewards, batch.rewards[4:])
    with pytest.raises(ValueError, match="over 2 ranks x 3 mini-batches"):
        batch.shard(0, 2, mini_batches=3)
