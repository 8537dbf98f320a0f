"""The step's prompts stage: where the run's prompts come from, and a step's (or a round's) prompts.

Sources (`take(key, count)` -> PromptRecords; `run_prompts` picks the config's):
- `TaskPrompts`: a built-in `rollout.task` (count, arithmetic, jsonl:, module:function);
  a function of (seed, key), the key being the step (`prompt_key`).
- `DatasetPrompts`: `data.train_files` through a `PromptStream`. The job keeps the stream
  position (a cursor, saved in checkpoints as `prompt_position`), so a step that needs
  more prompts (DAPO-style resampling) calls `take` again and the run stays
  reproducible: the prompts are a function of (seed, epoch, position).

Datasets are tokenized here (`load_prompt_files`, also the validation set's), with the
tokenizer the engines loaded (reading it from a GGUF file alone takes longer than
starting the actors); the files themselves were checked before Ray started (preflight).
"""

from __future__ import annotations

import hashlib
import logging

from rl_engine.config import RunConfig
from rl_engine.data import PromptDataset, PromptRecord, PromptStream, load_dataset

log = logging.getLogger("rl_engine.job")


class TaskPrompts:
    """The prompts of a built-in task, as records whose ground truth is the task's answer."""

    def __init__(self, task):
        self.task = task

    def take(self, step: int, count: int) -> list[PromptRecord]:
        prompts = self.task.prompts(count, step)
        answers = getattr(self.task, "answers", lambda c, s: [None] * c)(count, step)
        return [
            PromptRecord(
                messages=[], ground_truth=a, data_source=self.task.name, prompt_ids=list(p)
            )
            for p, a in zip(prompts, answers)
        ]

    def state(self) -> dict:
        return {}

    def restore(self, state: dict, step: int) -> None:
        """Nothing to restore: the task's prompts are a function of (seed, step)."""

    def metrics(self, records: list[PromptRecord]) -> dict[str, float]:
        return {}


class DatasetPrompts:
    """`data.train_files` as a seeded stream; `position` is the next stream position to serve."""

    def __init__(self, stream: PromptStream, prompts_per_step: int):
        self.stream, self.prompts_per_step = stream, prompts_per_step
        self.position = 0

    def take(self, step: int, count: int) -> list[PromptRecord]:
        """The next `count` prompts of the stream (and the cursor moves past them)."""
        self.epoch = self.stream.epoch_of(self.position)
        records = self.stream.take(self.position, count)
        self.position += count
        return records

    def state(self) -> dict:
        return {"prompt_position": self.position}

    def restore(self, state: dict, step: int) -> None:
        """The cursor of a checkpoint (one without it: every step took prompts_per_step)."""
        self.position = int(state.get("prompt_position", step * self.prompts_per_step))

    def metrics(self, records: list[PromptRecord]) -> dict[str, float]:
        dataset = self.stream.dataset
        return {
            "data/epoch": float(self.epoch),
            "data/prompts_filtered": float(dataset.filtered),
            "data/prompts_truncated": float(dataset.truncated),
        }


def run_prompts(config: RunConfig, task, tokenizer) -> TaskPrompts | DatasetPrompts:
    """The run's prompt source: `data.train_files` as a seeded stream, else the built-in `task`."""
    if config.data.train_files is None:
        return TaskPrompts(task)
    train = load_prompt_files(config, "train", tokenizer)
    stream = PromptStream(train, seed=config.seed, shuffle=config.data.shuffle)
    return DatasetPrompts(stream, config.rollout.prompts_per_step)


def load_prompt_files(config: RunConfig, split: str, tokenizer) -> PromptDataset:
    """`data.train_files` (split "train") or `data.val_files` ("validation"), tokenized, and
    what was filtered or truncated logged."""
    key = "train_files" if split == "train" else "val_files"
    dataset = load_dataset(getattr(config.data, key), config.data, tokenizer, key=f"data.{key}")
    lengths = [len(r.prompt_ids) for r in dataset.records]
    log.info(
        "%s prompts: %d (longest %d tokens; over data.max_prompt_length = %d: %d filtered, "
        "%d truncated), data sources %s",
        split,
        len(dataset),
        max(lengths),
        config.data.max_prompt_length,
        dataset.filtered,
        dataset.truncated,
        ", ".join(dataset.data_sources),
    )
    return dataset


def prompt_key(step: int, attempt: int) -> int:
    """The key a built-in task draws a round's prompts (and rewards) from: the step itself for
    round 0, else a negative 63-bit hash of (step, attempt), never a step's own key."""
    if attempt == 0:
        return step
    digest = hashlib.blake2b(f"filter/{step}/{attempt}".encode(), digest_size=8).digest()
    return -(int.from_bytes(digest, "little") >> 1) - 1


def records_of_source(completions) -> list[PromptRecord]:
    """Records for completions read from rollout.source (no ground truth is known there)."""
    count = max(c.prompt_index for c in completions) + 1
    by_index = {c.prompt_index: c for c in completions}
    return [
        PromptRecord(
            messages=[],
            ground_truth=None,
            data_source="rollout.source",
            prompt_ids=list(by_index[i].prompt_ids) if i in by_index else [],
        )
        for i in range(count)
    ]
