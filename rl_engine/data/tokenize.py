"""Prompts through the tokenizer's chat template, and `data.max_prompt_length` enforced.

`data.system_prompt` becomes the first turn of every prompt that has no system turn.
A tokenizer without a chat template gets the turns' contents joined by blank lines.
Longer prompts than `max_prompt_length` tokens are dropped (`truncation: filter`), cut
(`left` keeps the last tokens, `right` the first) or refused (`error`); how many is in
`PromptDataset.filtered` / `.truncated` (and the job's `data/*` metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.data.files import DataFileError
from rl_engine.data.records import PromptRecord


@dataclass(slots=True)
class PromptDataset:
    """Tokenized prompts ready to sample, and what enforcing the length did."""

    records: list[PromptRecord]
    filtered: int = 0
    """Prompts dropped for being longer than max_prompt_length (truncation: filter)."""
    truncated: int = 0
    """Prompts cut to max_prompt_length (truncation: left / right)."""

    def __len__(self) -> int:
        return len(self.records)

    @property
    def data_sources(self) -> list[str]:
        """The distinct data_source values, in first-seen order."""
        return list(dict.fromkeys(r.data_source for r in self.records))


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt is None or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ending with the assistant's turn about to start."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(t) for t in ids]
    return list(tokenizer.encode("\n\n".join(m["content"] for m in messages)))


def tokenize_records(
    records: list[PromptRecord],
    tokenizer,
    *,
    system_prompt: str | None,
    max_prompt_length: int,
    truncation: str,
    key: str,
) -> PromptDataset:
    """Each record's prompt_ids; too-long prompts handled by `truncation`. Raises DataFileError
    when nothing is left (every prompt too long) or, under 'error', at the first long prompt."""
    kept, filtered, truncated = [], 0, 0
    for record in records:
        ids = encode_messages(tokenizer, with_system_prompt(record.messages, system_prompt))
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise DataFileError(
                    f"{key}: {record.where} has {len(ids)} prompt tokens, more than "
                    f"data.max_prompt_length = {max_prompt_length} (data.truncation: error)"
                )
            if truncation == "filter":
                filtered += 1
                continue
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            truncated += 1
        record.prompt_ids = ids
        kept.append(record)
    if not kept:
        raise DataFileError(
            f"{key}: every one of {len(records)} prompts is longer than data.max_prompt_length = "
            f"{max_prompt_length} tokens (data.truncation: filter left none)"
        )
    return PromptDataset(kept, filtered=filtered, truncated=truncated)
