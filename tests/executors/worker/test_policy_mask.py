"""The policy mask of multi-turn episodes through TrainBatch and the worker's step.

An Episode's `policy_mask` becomes `response_mask`: an observation token is in the forward
(context) and never scored. In the padded and packed layouts, shards and micro-batches the
mask travels with its rows; the loss, parity, KL, entropy and the rollout correction read
the policy's tokens alone. Proof: changing an observation token's rollout logprob cannot
change the step (every metric and every updated weight are bitwise the same), while the
control, changing a policy token's, does.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from rl_engine.envs import Episode, EpisodeLimits, TurnCodec, run_episodes
from rl_engine.executors import BatchError
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.executors.worker.micro_batches import plan
from rl_engine.logprobs import IGNORE_INDEX
from rl_engine.rollout import SamplingParams
from tests.helpers.envs.scripted import Answer, engine_turns
from tests.helpers.worker.cell import GROUP, cell_config, prompts, rollout_engine

CONFIG = cell_config(0, 1, "float32")


@functools.cache
def episodes() -> tuple[Episode, ...]:
    """Two prompts x GROUP episodes of tiny-llama with 1- and 3-id observations."""
    engine = rollout_engine(CONFIG)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.9, seed=5, eos_token_id=2)
    made = iter(range(100))
    played = run_episodes(
        [{"prompt_ids": p} for p in prompts(engine.vocab_size, 5)],
        GROUP,
        engine_turns(engine, sampling),
        make_env=lambda: Answer(length=1 + 2 * (next(made) % 2), turns=3),
        codec=TurnCodec(None, engine.vocab_size),
        limits=EpisodeLimits(max_turns=3, max_total_tokens=64, timeout_s=10.0),
    )
    assert any(not all(e.policy_mask) for e in played)
    return tuple(played)


def batch_of(items, **kwargs) -> TrainBatch:
    return TrainBatch.from_completions(
        list(items), [e.reward for e in items], samples_per_prompt=GROUP, pad_token_id=2, **kwargs
    )


def observation_position(batch: TrainBatch) -> tuple[int, int]:
    """(row, column) of a (T-1)-wide position whose next token is an observation's."""
    inside = batch.attention_mask[:, 1:].bool() & ~batch.response_mask
    for row in range(batch.num_sequences):
        first = int(batch.response_mask[row].nonzero()[0])
        later = inside[row].nonzero()[:, 0]
        later = later[later > first]
        if later.numel():
            return row, int(later[0])
    raise AssertionError("no observation token in the batch")


def test_the_mask_is_the_response_mask_of_the_padded_layout():
    items = episodes()
    batch = batch_of(items)
    for row, e in enumerate(items):
        start = len(e.prompt_ids) - 1  # position scoring the first completion token
        mask = batch.response_mask[row, start : start + len(e.token_ids)]
        assert mask.tolist() == e.policy_mask
        assert int(batch.response_mask[row].sum()) == sum(e.policy_mask)
        assert torch.equal(
            batch.rollout_logprobs[row, start : start + len(e.token_ids)][mask],
            e.logprobs[torch.tensor(e.policy_mask)],
        )
        assert not bool(batch.rollout_logprobs[row][~batch.response_mask[row]].any())
    assert batch.num_tokens == sum(sum(e.policy_mask) for e in items)
    per_token = batch_of(items, advantage="reinforce_pp")
    assert not bool(per_token.advantages[~per_token.response_mask].any())
    assert bool(per_token.advantages[per_token.response_mask].ne(0).any())


@pytest.mark.parametrize(("packing", "budget"), [(False, 0), (True, 0), (True, 40), (False, 40)])
def test_shards_and_micro_batches_keep_the_mask(packing, budget):
    batch = batch_of(episodes())
    for rank in range(2):
        shard = batch.shard(rank, 2, mini_batches=2)
        rows = batch.shard_rows(rank, 2, mini_batches=2)
        assert torch.equal(shard.response_mask, batch.response_mask[rows])
        micro = plan(shard, micro_batch_size=2, max_tokens=budget, packing=packing)
        scored = 0
        for mb in micro:
            padded = torch.where(mb.batch.response_mask, mb.batch.input_ids[:, 1:], IGNORE_INDEX)
            targets = mb.targets()
            assert int((targets != IGNORE_INDEX).sum()) == mb.batch.num_tokens
            if packing:  # the packed row scores exactly the padded view's targets
                back = mb.packed.unpack_values(targets.float()).long()
                assert torch.equal(torch.where(mb.batch.response_mask, back, IGNORE_INDEX), padded)
            assert torch.equal(
                mb.batch.response_mask,
                shard.response_mask[list(mb.sequences)][:, : mb.batch.response_mask.shape[1]],
            )
            scored += mb.batch.num_tokens
        assert scored == shard.num_tokens


def test_a_mask_that_does_not_fit_is_a_batch_error():
    e = episodes()[0]
    short = dataclasses.replace(e, policy_mask=e.policy_mask[:-1])
    with pytest.raises(BatchError, match="policy_mask of .* entries"):
        batch_of([short] + list(episodes()[1:]))
    nothing = dataclasses.replace(e, policy_mask=[False] * len(e.token_ids))
    with pytest.raises(BatchError, match="marks no token as the policy's"):
        batch_of([nothing] + list(episodes()[1:]))


def _step(batch: TrainBatch, **algorithm) -> tuple[dict, dict]:
    """One step of a fresh worker (kl to the reference, parity reported): (metrics, weights)."""
    config = cell_config(0, 1, "float32", algorithm=algorithm)
    config = dataclasses.replace(config, parity="report")
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    metrics = worker.train_step(batch)
    return {k: v for k, v in metrics.items() if not k.startswith("time")}, worker.export_weights()


@pytest.mark.parametrize(
    "algorithm",
    [
        {"kl_coef": 0.05, "rollout_correction": "token_truncate", "advantage": "reinforce_pp"},
        pytest.param(
            {
                "rollout_correction": "sequence_mask",
                "ratio_level": "sequence",
                "loss_aggregation": "seq-mean-token-mean",
            },  # fmt: skip
            marks=pytest.mark.exhaustive,
        ),
    ],
    ids=["token-kl-correction", "gspo-sequence-mask"],
)
def test_an_observation_logprob_cannot_change_the_step(algorithm):
    batch = batch_of(episodes(), advantage=algorithm.get("advantage", "grpo"))
    row, col = observation_position(batch)
    moved = batch.rollout_logprobs.clone()
    moved[row, col] = -7.5
    observation_moved = dataclasses.replace(batch, rollout_logprobs=moved)
    policy = batch.rollout_logprobs.clone()
    policy_col = int(batch.response_mask[row].nonzero()[-1])
    policy[row, policy_col] -= 0.5
    policy_moved = dataclasses.replace(batch, rollout_logprobs=policy)

    base, base_weights = _step(batch, **algorithm)
    same, same_weights = _step(observation_moved, **algorithm)
    assert base["parity/exact_match_fraction"] == 1.0  # the episodes are exact to begin with
    assert base["parity/num_tokens"] == base["tokens"] == batch.num_tokens
    assert same == base
    assert all(torch.equal(base_weights[k], same_weights[k]) for k in base_weights)

    control, control_weights = _step(policy_moved, **algorithm)  # the negative control
    assert control["parity/exact_match_fraction"] < 1.0 and control["loss"] != base["loss"]
    assert any(not torch.equal(base_weights[k], control_weights[k]) for k in base_weights)
