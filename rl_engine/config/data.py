"""The `data:` section: prompt datasets in verl's layout, read by rl_engine.data.

rl_engine.data stays plain Python that takes these values as arguments; the schema and its
checks live here, with the other sections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_engine.base.fields import check_bool, check_choice, check_int, check_text, fail

TRUNCATIONS = ("filter", "left", "right", "error")


def _files(name: str, value: Any) -> list[str] | None:
    """None, one path or a list of paths -> None or a non-empty list of non-empty strings."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v for v in items):
        fail(name, "a path or a non-empty list of paths (parquet or JSON lines)", value)
    return list(items)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt datasets in verl's layout (docs/usage.md): parquet or JSON-lines files."""

    train_files: str | list[str] | None = None
    """Training prompts: one or more .parquet / .jsonl / .json files (null: rollout.task's prompts)."""
    val_files: str | list[str] | None = None
    """Held-out prompts the `eval` section scores (null: no evaluation)."""
    prompt_key: str = "prompt"
    """Column of the prompt: a list of chat messages ({role, content}) or plain text."""
    answer_key: str = "reward_model.ground_truth"
    """Column of the ground truth handed to the reward (dotted: a field inside a struct column)."""
    system_prompt: str | None = None
    """A system message put before every prompt that has none."""
    max_prompt_length: int = 1024
    """Most prompt tokens after the chat template; longer prompts are handled by `truncation`."""
    truncation: str = "filter"
    """Prompts over max_prompt_length: 'filter' (dropped), 'left' / 'right' (tokens cut on that
    side), 'error' (a config error naming the row)."""
    shuffle: bool = True
    """Each epoch visits the rows in a shuffled order from (seed, epoch); false: file order."""

    def __post_init__(self) -> None:
        self.train_files = _files("data.train_files", self.train_files)
        self.val_files = _files("data.val_files", self.val_files)
        check_text("data.prompt_key", self.prompt_key)
        check_text("data.answer_key", self.answer_key)
        if self.system_prompt is not None:
            check_text("data.system_prompt", self.system_prompt)
        check_int("data.max_prompt_length", self.max_prompt_length, 1)
        check_choice("data.truncation", self.truncation, TRUNCATIONS)
        check_bool("data.shuffle", self.shuffle)
