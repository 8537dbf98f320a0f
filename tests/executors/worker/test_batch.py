"""TrainBatch: layout of completions, sharding, micro-batches, and validation errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.executors import BatchError
from rl_engine.executors.worker.batch import TrainBatch
from tests.helpers.worker.completions import completion, two_groups


def test_layout_is_right_padded_and_aligned():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    assert batch.input_ids.shape == (4, 7) and batch.response_mask.shape == (4, 6)
    assert batch.input_ids[0].tolist() == [5, 6, 7, 10, 11, 0, 0]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    # position t scores token t+1: the completion of row 0 is scored at positions 2 and 3
    assert batch.response_mask[0].tolist() == [False, False, True, True, False, False]
    assert torch.equal(batch.rollout_logprobs[0, 2:4], comps[0].logprobs)
    assert batch.response_mask[2].tolist() == [True, False, False, False, False, False]
    assert batch.num_tokens == 2 + 4 + 1 + 3
    assert batch.rollout_logprobs[~batch.response_mask].abs().sum() == 0
    # GRPO advantages within each group of 2: +/- the same magnitude
    assert (
        batch.advantages[0] > 0 > batch.advantages[1]
        and batch.advantages[3] > 0 > batch.advantages[2]
    )
    assert batch.rewards.tolist() == rewards


def test_shard_and_micro_batches():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    shard = batch.shard(1, 2)
    assert torch.equal(shard.input_ids, batch.input_ids[2:]) and torch.equal(
        shard.advantages, batch.advantages[2:]
    )
    micro = batch.micro_batches(3)
    assert [m.num_sequences for m in micro] == [3, 1]
    assert torch.equal(torch.cat([m.rollout_logprobs for m in micro]), batch.rollout_logprobs)
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        batch.shard(0, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        batch.shard(2, 2)
    with pytest.raises(ValueError, match="micro-batch size must be >= 1"):
        batch.micro_batches(0)


def test_validate_names_out_of_vocabulary_tokens():
    comps, rewards = two_groups()
    comps[3] = completion([8], [21, 1000, 23], index=1)
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    with pytest.raises(
        ValueError,
        match=r"sequence 3: position 2 \(a token\) holds token id 1000, outside the vocabulary of 1000",
    ):
        batch.validate(1000)
    with pytest.raises(ValueError, match="sequence 3"):
        TrainBatch.from_completions(
            comps, rewards, samples_per_prompt=2, pad_token_id=0, vocab_size=1000
        )
    comps[3] = completion([8], [-1, 3, 4], index=1)
    with pytest.raises(ValueError, match=r"sequence 3: position 1 \(a token\) holds token id -1"):
        TrainBatch.from_completions(
            comps, rewards, samples_per_prompt=2, pad_token_id=0, vocab_size=1000
        )


def test_empty_completion():
    comps, rewards = two_groups()
    comps[1] = completion([5, 6, 7], [])
    with pytest.raises(ValueError, match="sequence 1 is an empty completion"):
        TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_empty_prompt():
    comps, rewards = two_groups()
    comps[2] = completion([], [3, 4], index=1)
    with pytest.raises(ValueError, match="sequence 2 has an empty prompt"):
        TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_logprob_count_must_match_tokens():
    comps, rewards = two_groups()
    comps[2] = completion([8], [20, 21], logprobs=[-1.0], index=1)
    with pytest.raises(ValueError, match="sequence 2: 2 token_ids but 1 logprobs"):
        TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_non_finite_rollout_logprobs():
    comps, rewards = two_groups()
    comps[0] = completion([5], [6, 7], logprobs=[-1.0, float("-inf")])
    with pytest.raises(ValueError, match="sequence 0: rollout logprobs must be finite"):
        TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def test_rewards_count_mismatch():
    comps, rewards = two_groups()
    with pytest.raises(ValueError, match="got 3 rewards for 4 completions"):
        TrainBatch.from_completions(comps, rewards[:3], samples_per_prompt=2, pad_token_id=0)


def test_no_completions_and_bad_samples_per_prompt():
    with pytest.raises(ValueError, match="no completions"):
        TrainBatch.from_completions([], [], samples_per_prompt=2, pad_token_id=0)
    comps, rewards = two_groups()
    with pytest.raises(BatchError, match=r"needs samples_per_prompt=3 completions.*\{0: 2, 1: 2\}"):
        TrainBatch.from_completions(comps, rewards, samples_per_prompt=3, pad_token_id=0)


def test_all_masked_batch():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    batch.response_mask[:] = False
    with pytest.raises(ValueError, match="response_mask selects no tokens"):
        batch.validate(1000)


def test_shapes_and_mask_consistency_are_checked():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"TrainBatch.advantages must have shape \(4,\)"):
        TrainBatch(
            batch.input_ids,
            batch.attention_mask,
            batch.response_mask,
            batch.rollout_logprobs,
            batch.advantages[:3],
            batch.rewards,
        )
    mask = batch.response_mask.clone()
    mask[0, 5] = True  # scores padding
    with pytest.raises(
        ValueError, match=r"response_mask\[0, 5\] is set but token 5 or 6 of sequence 0 is padding"
    ):
        TrainBatch(
            batch.input_ids,
            batch.attention_mask,
            mask,
            batch.rollout_logprobs,
            batch.advantages,
            batch.rewards,
        )


def test_groups_follow_prompt_index_not_list_order():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    order = [2, 0, 3, 1]  # interleaved prompts
    shuffled = TrainBatch.from_completions(
        [comps[i] for i in order], [rewards[i] for i in order], pad_token_id=0
    )
    assert torch.equal(shuffled.advantages, batch.advantages[order])
    assert torch.equal(shuffled.input_ids[:, :3], batch.input_ids[order, :3])


def test_pad_token_id_is_required_and_checked():
    comps, rewards = two_groups()
    for bad in (None, -1, True):
        with pytest.raises(BatchError, match="pad_token_id must be an int >= 0.*eos_token_id"):
            TrainBatch.from_completions(comps, rewards, pad_token_id=bad)


def test_batch_carries_one_temperature_and_weight_version():
    comps = [completion([5], [6, 7], temperature=0.7, version=3, index=i // 2) for i in range(4)]
    batch = TrainBatch.from_completions(comps, [0.0, 1.0, 1.0, 0.0], pad_token_id=0)
    assert (batch.logprob_temperature, batch.weight_version) == (0.7, 3)
    shard = batch.shard(1, 2).micro_batches(1)[0].to("cpu")
    assert (shard.logprob_temperature, shard.weight_version) == (0.7, 3)
    comps[3] = completion([5], [6, 7], temperature=1.0, version=3, index=1)
    with pytest.raises(BatchError, match=r"different logprob_temperature values \[0.7, 1.0\]"):
        TrainBatch.from_completions(comps, [0.0, 1.0, 1.0, 0.0], pad_token_id=0)
    comps[3] = completion([5], [6, 7], temperature=0.7, version=2, index=1)
    with pytest.raises(BatchError, match=r"different weight_version values \[2, 3\]"):
        TrainBatch.from_completions(comps, [0.0, 1.0, 1.0, 0.0], pad_token_id=0)


def test_validate_covers_padding_and_finiteness():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, pad_token_id=999)
    batch.validate(1000)
    with pytest.raises(
        BatchError, match=r"sequence 0: position 5 \(a padding position\) holds token id 999"
    ):
        batch.validate(999)
    for name in ("advantages", "rewards"):
        values = getattr(batch, name).clone()
        values[2] = float("nan")
        with pytest.raises(BatchError, match=rf"{name} must be finite; {name}\[2\] = nan"):
            dataclasses.replace(batch, **{name: values}).validate(1000)
    logprobs = batch.rollout_logprobs.clone()
    logprobs[1, 0] = float("-inf")
    with pytest.raises(BatchError, match=r"rollout_logprobs must be finite"):
        dataclasses.replace(batch, rollout_logprobs=logprobs).validate(1000)
    batch.attention_mask = batch.attention_mask[:, :-1]  # mutated after construction
    with pytest.raises(BatchError, match="attention_mask must have shape"):
        batch.validate(1000)
