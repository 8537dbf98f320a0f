"""The rollout engine's argument checks: its model, sizes and weight versions, and the sampling
and prompts of a `generate` call (prompts normalised to lists of token ids). Each raises a
ValueError that names the argument, before anything runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rl_engine.base.fields import is_int
from rl_engine.rollout.sampling import SamplingParams


def check_model(model, device: torch.device) -> None:
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise ValueError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("model has no parameters")
    same = param.device.type == device.type and (
        device.index is None or param.device.index == device.index
    )
    if not same:
        raise ValueError(
            f"model is on {param.device}, but the engine's device is {device}; move the model first"
        )


def check_max_batch_size(max_batch_size) -> int:
    if not is_int(max_batch_size) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    return max_batch_size


def resolve_max_seq_len(model, max_seq_len) -> int:
    if max_seq_len is None:
        max_seq_len = getattr(model.config, "max_position_embeddings", None)
        if max_seq_len is None:
            raise ValueError(
                "max_seq_len is None and the model config has no max_position_embeddings; pass it"
            )
    if not is_int(max_seq_len) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    return max_seq_len


def check_version(version) -> int:
    if not is_int(version):
        raise ValueError(f"version must be an int, got {version!r}")
    return version


def check_sampling(sampling) -> SamplingParams:
    """`sampling`, or the default `SamplingParams()` when None."""
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    return sampling


def check_prompts(
    prompts, *, vocab_size: int, max_seq_len: int, max_new_tokens: int
) -> list[list[int]]:
    """Every prompt as a non-empty list of in-vocabulary token ids that leaves room for
    `max_new_tokens` within `max_seq_len`."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a list of token-id lists or 1-D tensors, got {type(prompts).__name__}"
        )
    return [
        _check_prompt(i, p, vocab_size, max_seq_len, max_new_tokens) for i, p in enumerate(prompts)
    ]


def _check_prompt(
    index: int, prompt, vocab_size: int, max_seq_len: int, max_new_tokens: int
) -> list[int]:
    ids = _as_id_list(index, prompt)
    if not ids:
        raise ValueError(f"prompt {index} is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"prompt {index} has token id {bad} outside the vocabulary [0, {vocab_size})"
        )
    total = len(ids) + max_new_tokens
    if total > max_seq_len:
        raise ValueError(
            f"prompt {index}: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} "
            f"= {total} > max_seq_len {max_seq_len}"
        )
    return ids


def _as_id_list(index: int, prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(
                f"prompt {index} must be a 1-D integer tensor, got shape {tuple(prompt.shape)} dtype {prompt.dtype}"
            )
        return prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise ValueError(
            f"prompt {index} must be a list of token ids or a 1-D tensor, got {type(prompt).__name__}"
        )
    bad = next((t for t in prompt if not is_int(t)), None)
    if bad is not None:
        raise ValueError(f"prompt {index} has a non-integer token id {bad!r}")
    return list(prompt)


def check_budgets(budgets, prompts: int, most: int) -> list[int | None]:
    """Each prompt's own budget of sampled tokens, in [1, most]; None: `most` for all."""
    if budgets is None:
        return [None] * prompts
    budgets = list(budgets)
    if len(budgets) != prompts:
        raise ValueError(f"budgets must give one per prompt ({prompts}), got {len(budgets)}")
    for index, budget in enumerate(budgets):
        if not is_int(budget) or not 1 <= budget <= most:
            raise ValueError(
                f"budgets[{index}] must be an int in [1, sampling.max_new_tokens = {most}], "
                f"got {budget!r}"
            )
    return budgets
