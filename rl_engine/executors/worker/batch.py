"""`TrainBatch`: the completions of one RL step laid out for the trainer.

Layout (B sequences, T columns, right padding):

    input_ids       (B, T)    int64  prompt + completion, then `pad_token_id`
    attention_mask  (B, T)    int64  1 on real tokens
    response_mask   (B, T-1)  bool   position t scores a completion token the policy sampled
                                     (token t+1): the policy mask of multi-turn episodes
    rollout_logprobs(B, T-1)  fp32   the rollout engine's logprob of token t+1; 0 off the mask
    advantages      (B,) or (B, T-1)  fp32   one per sequence (broadcast over its completion
                                     tokens) or per token, aligned with response_mask
    rewards         (B,)      fp32
    logprob_temperature  float       the T of the rollout logprobs, log_softmax(logits / T)
    weight_version       int | None  the policy version that sampled the batch (None: unknown)

Position t of the (T-1)-wide tensors scores token t+1 given tokens <= t, the
convention of `rl_engine.logprobs.token_logprobs`. Every error about a batch's
content is a `BatchError` (a ValueError).

Multi-turn episodes (rl_engine.envs.Episode) hold the environment's observations among their
completion tokens; their `policy_mask` (one bool per completion token) becomes response_mask,
so an observation token is context: in the forward, never scored. Everything the worker
counts reads response_mask alone (the loss and its normaliser, parity, KL, entropy, rollout
correction, token counts, per-token advantages), in the padded and packed layouts alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rl_engine.algorithms import compute_advantages
from rl_engine.executors.worker.errors import BatchError

_TENSORS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "rollout_logprobs",
    "advantages",
    "rewards",
)


@dataclass(slots=True)
class TrainBatch:
    """Right-padded prompt+completion sequences with the rollout's logprobs and advantages."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    response_mask: torch.Tensor  # (B, T-1) bool
    rollout_logprobs: torch.Tensor  # (B, T-1) fp32
    advantages: torch.Tensor  # (B,) or (B, T-1) fp32
    rewards: torch.Tensor  # (B,) fp32
    logprob_temperature: float = 1.0
    weight_version: int | None = None

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
        samples_per_prompt: int | None = None,
        pad_token_id: int | None = None,
        normalize_std: bool = True,
        vocab_size: int | None = None,
        advantage: str | None = "grpo",
        gamma: float = 1.0,
    ) -> TrainBatch:
        """Lay out rollout `Completion`s (rows in the given order) with their rewards.

        GRPO groups are the completions sharing a `prompt_index` (in any order); each group
        must have `samples_per_prompt` members when given, else all groups the same size.
        Advantages are `compute_advantages(advantage, ...)` over the groups (`grpo`, `rloo`:
        one per sequence, (B,); `reinforce_pp`, `reinforce_pp_baseline`: per token, (B, T-1),
        whitened over the batch's completion tokens). `advantage=None`: zeros (B,), for a caller
        that sets them from this layout itself (PPO: GAE from the critic's values of these
        rows, `with_advantages`). `pad_token_id` fills
        the right padding (pass the tokenizer's pad id or the model's `config.eos_token_id`).
        A completion with a `policy_mask` (an episode: one bool per token_ids) is scored on its
        True tokens only (response_mask); its other tokens are context.
        With `vocab_size`, token ids are checked against it here too (the worker always checks).
        """
        _check_completions(completions, rewards)
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise BatchError(
                f"pad_token_id must be an int >= 0, got {pad_token_id!r}: pass the id to pad with, "
                "e.g. the tokenizer's pad_token_id or the model's config.eos_token_id"
            )
        rewards_t = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)  # (B,)
        if not bool(torch.isfinite(rewards_t).all()):
            raise BatchError(f"rewards must be finite, got {rewards_t.tolist()}")
        width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
        rows = [_layout(c, width, pad_token_id) for c in completions]
        response_mask = torch.stack([r[2] for r in rows])
        batch = cls(
            input_ids=torch.stack([r[0] for r in rows]),
            attention_mask=torch.stack([r[1] for r in rows]),
            response_mask=response_mask,
            rollout_logprobs=torch.stack([r[3] for r in rows]),
            advantages=_grouped_advantages(
                completions,
                rewards_t,
                samples_per_prompt,
                advantage=advantage,
                mask=response_mask,
                normalize_std=normalize_std,
                gamma=gamma,
            ),
            rewards=rewards_t,
            logprob_temperature=_one_value(completions, "logprob_temperature"),
            weight_version=_one_value(completions, "weight_version"),
        )
        if vocab_size is not None:
            batch.validate(vocab_size)
        return batch

    def validate(self, vocab_size: int) -> None:
        """Raise BatchError for anything the trainer cannot train on.

        Checked: shapes and dtypes (again: the batch may have been mutated), every token id
        fed to the model, padding included, in [0, vocab_size); no empty sequence; finite
        advantages, rewards and rollout logprobs; a finite logprob_temperature > 0; at
        least one scored token.
        """
        _check_shapes(self)
        ids = self.input_ids
        bad = (ids < 0) | (ids >= vocab_size)
        if bool(bad.any()):
            row, col = (int(v) for v in bad.nonzero()[0])
            what = "a padding position" if not bool(self.attention_mask[row, col]) else "a token"
            raise BatchError(
                f"sequence {row}: position {col} ({what}) holds token id {int(ids[row, col])}, outside "
                f"the vocabulary of {vocab_size} entries (valid ids 0..{vocab_size - 1})"
            )
        empty = (self.attention_mask.sum(dim=1) == 0).nonzero()
        if empty.numel():
            raise BatchError(f"sequence {int(empty[0])} is empty (attention_mask is all 0)")
        for name in ("advantages", "rewards", "rollout_logprobs"):
            values = getattr(self, name)
            finite = torch.isfinite(values)
            if not bool(finite.all()):
                index = tuple(int(v) for v in (~finite).nonzero()[0])
                raise BatchError(
                    f"{name} must be finite; {name}[{', '.join(map(str, index))}] = {float(values[index])}"
                )
        t = self.logprob_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise BatchError(f"logprob_temperature must be a finite number > 0, got {t!r}")
        if not bool(self.response_mask.any()):
            raise BatchError(
                "response_mask selects no tokens: the batch has no completion token to train on"
            )

    def shard(self, rank: int, world_size: int, mini_batches: int = 1) -> TrainBatch:
        """This rank's rows. One mini-batch: [rank * B / world_size, (rank + 1) * B / world_size),
        a contiguous block. K mini-batches (`trainer.mini_batch_size`): the batch is K
        consecutive blocks of M = B / K rows, and the rank takes its M / world_size rows of
        each, in order; so mini-batch j is rows [j M, (j + 1) M) whatever the world size."""
        rows = self.shard_rows(rank, world_size, mini_batches)
        if mini_batches == 1:
            return self._rows(slice(int(rows[0]), int(rows[-1]) + 1))
        return self._index(rows)

    def shard_rows(self, rank: int, world_size: int, mini_batches: int = 1) -> torch.Tensor:
        """(B / world_size,) int64: the rows `shard(rank, world_size, mini_batches)` takes, in
        its order (to shard per-sequence tensors that travel beside the batch the same way)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if mini_batches < 1 or self.num_sequences % (world_size * mini_batches) != 0:
            raise ValueError(
                f"batch of {self.num_sequences} sequences cannot be split evenly over "
                f"{world_size} ranks"
                + (f" x {mini_batches} mini-batches" if mini_batches > 1 else "")
            )
        size = self.num_sequences // (world_size * mini_batches)
        block = size * world_size
        rows = [j * block + rank * size + i for j in range(mini_batches) for i in range(size)]
        return torch.tensor(rows, dtype=torch.long)

    def with_advantages(self, advantages: torch.Tensor) -> TrainBatch:
        """This batch with `advantages` ((B,) or (B, T-1) fp32, checked like the constructor's)."""
        return replace(self, advantages=advantages)

    def micro_batches(self, size: int) -> list[TrainBatch]:
        """Consecutive slices of `size` sequences (the last one may be smaller)."""
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        return [self._rows(slice(s, s + size)) for s in range(0, self.num_sequences, size)]

    def to(self, device: str | torch.device) -> TrainBatch:
        return replace(self, **{name: getattr(self, name).to(device) for name in _TENSORS})

    def _rows(self, rows: slice) -> TrainBatch:
        return replace(self, **{name: getattr(self, name)[rows] for name in _TENSORS})

    def _index(self, rows: torch.Tensor) -> TrainBatch:
        """The sequences `rows` (a 1-D index tensor), in that order."""
        return replace(
            self, **{name: getattr(self, name).index_select(0, rows) for name in _TENSORS}
        )

    def _columns(self, width: int) -> TrainBatch:
        """The first `width` columns (and width - 1 scored positions) of every sequence."""
        return replace(
            self,
            input_ids=self.input_ids[:, :width],
            attention_mask=self.attention_mask[:, :width],
            response_mask=self.response_mask[:, : width - 1],
            rollout_logprobs=self.rollout_logprobs[:, : width - 1],
            advantages=self.advantages
            if self.advantages.dim() == 1
            else self.advantages[:, : width - 1],
        )


def _one_value(completions, name: str):
    """The value of `name` shared by every completion (a batch comes from one sampling)."""
    values = sorted({getattr(c, name) for c in completions}, key=repr)
    if len(values) > 1:
        raise BatchError(
            f"completions carry different {name} values {values}: one batch must have one "
            f"{name} (build one batch per value)"
        )
    return values[0]


# estimators whose advantage is one number per sequence: the batch keeps them (B,)
_PER_SEQUENCE = ("grpo", "rloo")


def _grouped_advantages(
    completions, rewards, samples_per_prompt, *, advantage, mask, normalize_std, gamma
):
    """The estimator's advantages over the groups of completions sharing a prompt_index."""
    groups: dict[int, list[int]] = {}
    for row, c in enumerate(completions):
        groups.setdefault(c.prompt_index, []).append(row)
    sizes = {len(rows) for rows in groups.values()}
    expected = samples_per_prompt if samples_per_prompt is not None else max(sizes)
    wrong = {p: len(rows) for p, rows in groups.items() if len(rows) != expected}
    if wrong:
        raise BatchError(
            f"every prompt needs samples_per_prompt={expected} completions; prompt_index -> count "
            f"differs for {wrong}"
        )
    if advantage is None:  # set later from this layout (PPO's GAE)
        return torch.zeros(len(completions), dtype=torch.float32)
    group_index = torch.tensor([c.prompt_index for c in completions], dtype=torch.long)
    options = {"normalize_std": normalize_std} if advantage == "grpo" else {"gamma": gamma}
    return compute_advantages(
        advantage,
        rewards,
        group_index,
        mask=None if advantage in _PER_SEQUENCE else mask,
        **options,
    )


def _check_completions(completions, rewards) -> None:
    if len(completions) == 0:
        raise BatchError("no completions: a TrainBatch needs at least one")
    if len(rewards) != len(completions):
        raise BatchError(f"got {len(rewards)} rewards for {len(completions)} completions")
    for i, c in enumerate(completions):
        if len(c.prompt_ids) == 0:
            raise BatchError(
                f"sequence {i} has an empty prompt: its first token has no context to score it"
            )
        if len(c.token_ids) == 0:
            raise BatchError(
                f"sequence {i} is an empty completion (no token_ids): nothing to train on"
            )
        if len(c.token_ids) != len(c.logprobs):
            raise BatchError(
                f"sequence {i}: {len(c.token_ids)} token_ids but {len(c.logprobs)} logprobs (must be one per token)"
            )
        logprobs = torch.as_tensor(c.logprobs, dtype=torch.float32)
        if not bool(torch.isfinite(logprobs).all()):
            raise BatchError(
                f"sequence {i}: rollout logprobs must be finite, got {logprobs.tolist()}"
            )
        _check_policy_mask(i, c)


def _policy_mask(completion) -> torch.Tensor | None:
    """(len(token_ids),) bool: which completion tokens the policy sampled (None: all of them)."""
    mask = getattr(completion, "policy_mask", None)
    return None if mask is None else torch.as_tensor(list(mask), dtype=torch.bool)


def _check_policy_mask(i: int, completion) -> None:
    mask = _policy_mask(completion)
    if mask is None:
        return
    if mask.shape != (len(completion.token_ids),):
        raise BatchError(
            f"sequence {i}: {len(completion.token_ids)} token_ids but a policy_mask of "
            f"{mask.numel()} entries (must be one per token)"
        )
    if not bool(mask.any()):
        raise BatchError(f"sequence {i}: policy_mask marks no token as the policy's")


def _layout(completion, width: int, pad_token_id: int):
    """One row: (ids (T,), mask (T,), response_mask (T-1,), rollout logprobs (T-1,))."""
    prompt, tokens = list(completion.prompt_ids), list(completion.token_ids)
    length = len(prompt) + len(tokens)
    ids = torch.full((width,), pad_token_id, dtype=torch.long)
    ids[:length] = torch.tensor(prompt + tokens, dtype=torch.long)
    mask = torch.zeros(width, dtype=torch.long)
    mask[:length] = 1
    policy = _policy_mask(completion)
    scored = slice(len(prompt) - 1, length - 1)  # position t scores token t+1
    response = torch.zeros(width - 1, dtype=torch.bool)
    response[scored] = True if policy is None else policy
    logprobs = torch.zeros(width - 1, dtype=torch.float32)
    logprobs[scored] = torch.as_tensor(completion.logprobs, dtype=torch.float32)
    logprobs[~response] = 0.0  # an environment token's entry is never read: 0, as padding
    return ids, mask, response, logprobs


def _check_shapes(batch: TrainBatch) -> None:
    b, t = batch.input_ids.shape if batch.input_ids.dim() == 2 else (None, None)
    if b is None or t < 2:
        raise BatchError(
            f"input_ids must be (B, T) with T >= 2, got shape {tuple(batch.input_ids.shape)}"
        )
    per_token = batch.advantages.dim() == 2
    expected = {
        "attention_mask": (b, t),
        "response_mask": (b, t - 1),
        "rollout_logprobs": (b, t - 1),
        "advantages": (b, t - 1) if per_token else (b,),
        "rewards": (b,),
    }
    for name, shape in expected.items():
        actual = tuple(getattr(batch, name).shape)
        if actual != shape:
            what = f"{(b,)} or {(b, t - 1)}" if name == "advantages" else f"{shape}"
            raise BatchError(
                f"TrainBatch.{name} must have shape {what} (input_ids is {(b, t)}), got {actual}"
            )
    if batch.input_ids.dtype != torch.long:
        raise BatchError(f"TrainBatch.input_ids must be int64, got {batch.input_ids.dtype}")
    if batch.rollout_logprobs.dtype != torch.float32:
        raise BatchError(
            f"TrainBatch.rollout_logprobs must be float32, got {batch.rollout_logprobs.dtype}"
        )
    if batch.response_mask.dtype != torch.bool:
        raise BatchError(f"TrainBatch.response_mask must be bool, got {batch.response_mask.dtype}")
    scored = batch.response_mask & ~(
        batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    )
    if bool(scored.any()):
        row, col = (int(v) for v in scored.nonzero()[0])
        raise BatchError(
            f"response_mask[{row}, {col}] is set but token {col} or {col + 1} of sequence {row} is padding"
        )
