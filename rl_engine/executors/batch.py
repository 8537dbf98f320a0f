"""`TrainBatch`: the completions of one RL step laid out for the trainer.

Layout (B sequences, T columns, right padding):

    input_ids       (B, T)    int64  prompt + completion, then `pad_token_id`
    attention_mask  (B, T)    int64  1 on real tokens
    response_mask   (B, T-1)  bool   position t scores a completion token (token t+1)
    rollout_logprobs(B, T-1)  fp32   the rollout engine's logprob of token t+1; 0 off the mask
    advantages      (B,)      fp32   group-normalised (GRPO) per sequence
    rewards         (B,)      fp32

Position t of the (T-1)-wide tensors scores token t+1 given tokens <= t, the
convention of `rl_engine.logprobs.token_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rl_engine.algorithms import group_normalized_advantages


@dataclass(slots=True)
class TrainBatch:
    """Right-padded prompt+completion sequences with the rollout's logprobs and advantages."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    response_mask: torch.Tensor  # (B, T-1) bool
    rollout_logprobs: torch.Tensor  # (B, T-1) fp32
    advantages: torch.Tensor  # (B,) fp32
    rewards: torch.Tensor  # (B,) fp32

    def __post_init__(self) -> None:
        _check_shapes(self)

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Completion tokens scored (True entries of response_mask)."""
        return int(self.response_mask.sum())

    @classmethod
    def from_completions(
        cls,
        completions: Sequence,
        rewards: Sequence[float] | torch.Tensor,
        *,
        group_size: int,
        pad_token_id: int,
        normalize_std: bool = True,
        vocab_size: int | None = None,
    ) -> TrainBatch:
        """Lay out rollout `Completion`s (prompt-major, `group_size` per prompt) with their rewards.

        Advantages are `group_normalized_advantages(rewards, group_size)`. With
        `vocab_size`, token ids are checked against it here too (the worker always checks).
        """
        _check_completions(completions, rewards)
        rewards_t = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)  # (B,)
        if not bool(torch.isfinite(rewards_t).all()):
            raise ValueError(f"rewards must be finite, got {rewards_t.tolist()}")
        width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
        rows = [_layout(i, c, width, pad_token_id) for i, c in enumerate(completions)]
        batch = cls(
            input_ids=torch.stack([r[0] for r in rows]),
            attention_mask=torch.stack([r[1] for r in rows]),
            response_mask=torch.stack([r[2] for r in rows]),
            rollout_logprobs=torch.stack([r[3] for r in rows]),
            advantages=group_normalized_advantages(
                rewards_t, group_size, normalize_std=normalize_std
            ),
            rewards=rewards_t,
        )
        if vocab_size is not None:
            batch.validate(vocab_size)
        return batch

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError for token ids outside [0, vocab_size), or a batch with nothing to score."""
        live = self.attention_mask.bool()
        for i in range(self.num_sequences):
            ids = self.input_ids[i][live[i]]
            if ids.numel() == 0:
                raise ValueError(f"sequence {i} is empty (attention_mask is all 0)")
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab_size:
                raise ValueError(
                    f"sequence {i}: token ids span [{low}, {high}] but the vocabulary has {vocab_size} "
                    f"entries (valid ids 0..{vocab_size - 1})"
                )
        if not bool(self.response_mask.any()):
            raise ValueError(
                "response_mask selects no tokens: the batch has no completion token to train on"
            )

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rows [rank * B / world_size, (rank + 1) * B / world_size): this rank's contiguous block."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if self.num_sequences % world_size != 0:
            raise ValueError(
                f"batch of {self.num_sequences} sequences cannot be split evenly over {world_size} ranks"
            )
        size = self.num_sequences // world_size
        return self._rows(slice(rank * size, (rank + 1) * size))

    def micro_batches(self, size: int) -> list[TrainBatch]:
        """Consecutive slices of `size` sequences (the last one may be smaller)."""
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        return [self._rows(slice(s, s + size)) for s in range(0, self.num_sequences, size)]

    def to(self, device: str | torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def _rows(self, rows: slice) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def _check_completions(completions, rewards) -> None:
    if len(completions) == 0:
        raise ValueError("no completions: a TrainBatch needs at least one")
    if len(rewards) != len(completions):
        raise ValueError(f"got {len(rewards)} rewards for {len(completions)} completions")
    for i, c in enumerate(completions):
        if len(c.prompt_ids) == 0:
            raise ValueError(
                f"sequence {i} has an empty prompt: its first token has no context to score it"
            )
        if len(c.token_ids) == 0:
            raise ValueError(
                f"sequence {i} is an empty completion (no token_ids): nothing to train on"
            )
        if len(c.token_ids) != len(c.logprobs):
            raise ValueError(
                f"sequence {i}: {len(c.token_ids)} token_ids but {len(c.logprobs)} logprobs (must be one per token)"
            )
        logprobs = torch.as_tensor(c.logprobs, dtype=torch.float32)
        if not bool(torch.isfinite(logprobs).all()):
            raise ValueError(
                f"sequence {i}: rollout logprobs must be finite, got {logprobs.tolist()}"
            )


def _layout(index: int, completion, width: int, pad_token_id: int):
    """One row: (ids (T,), mask (T,), response_mask (T-1,), rollout logprobs (T-1,))."""
    prompt, tokens = list(completion.prompt_ids), list(completion.token_ids)
    length = len(prompt) + len(tokens)
    ids = torch.full((width,), pad_token_id, dtype=torch.long)
    ids[:length] = torch.tensor(prompt + tokens, dtype=torch.long)
    mask = torch.zeros(width, dtype=torch.long)
    mask[:length] = 1
    response = torch.zeros(width - 1, dtype=torch.bool)
    response[len(prompt) - 1 : length - 1] = True  # position t scores token t+1
    logprobs = torch.zeros(width - 1, dtype=torch.float32)
    logprobs[len(prompt) - 1 : length - 1] = torch.as_tensor(
        completion.logprobs, dtype=torch.float32
    )
    return ids, mask, response, logprobs


def _check_shapes(batch: TrainBatch) -> None:
    b, t = batch.input_ids.shape if batch.input_ids.dim() == 2 else (None, None)
    if b is None or t < 2:
        raise ValueError(
            f"input_ids must be (B, T) with T >= 2, got shape {tuple(batch.input_ids.shape)}"
        )
    expected = {
        "attention_mask": (b, t),
        "response_mask": (b, t - 1),
        "rollout_logprobs": (b, t - 1),
        "advantages": (b,),
        "rewards": (b,),
    }
    for name, shape in expected.items():
        actual = tuple(getattr(batch, name).shape)
        if actual != shape:
            raise ValueError(
                f"TrainBatch.{name} must have shape {shape} (input_ids is {(b, t)}), got {actual}"
            )
    if batch.input_ids.dtype != torch.long:
        raise ValueError(f"TrainBatch.input_ids must be int64, got {batch.input_ids.dtype}")
    if batch.rollout_logprobs.dtype != torch.float32:
        raise ValueError(
            f"TrainBatch.rollout_logprobs must be float32, got {batch.rollout_logprobs.dtype}"
        )
    if batch.response_mask.dtype != torch.bool:
        raise ValueError(f"TrainBatch.response_mask must be bool, got {batch.response_mask.dtype}")
    scored = batch.response_mask & ~(
        batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    )
    if bool(scored.any()):
        row, col = (int(v) for v in scored.nonzero()[0])
        raise ValueError(
            f"response_mask[{row}, {col}] is set but token {col} or {col + 1} of sequence {row} is padding"
        )
