"""A step's prompts and how its completions are scored, whichever source the config names.

Prompts (`take(step, count)` -> PromptRecords):
- `TaskPrompts`: a built-in `rollout.task` (count, arithmetic, jsonl:, module:function);
  a function of (seed, step).
- `DatasetPrompts`: `data.train_files` through a `PromptStream`. The job keeps the stream
  position (a cursor, saved in checkpoints as `prompt_position`), so a step that needs
  more prompts (DAPO-style resampling) calls `take` again and the run stays
  reproducible: the prompts are a function of (seed, epoch, position).

Scorers (`score(records, completions)` -> (rewards, metrics)):
- `TaskScorer`: the built-in task's own reward (no metrics: old runs log what they did);
- `FunctionScorer`: a verl compute_score (`reward.function`, or by data_source when a
  dataset is set) on the decoded completion, in the driver or the Ray reward workers;
  raises and timeouts are counted under `reward/` and scored 0, or fail the step.
"""

from __future__ import annotations

from rl_engine.data import PromptRecord, PromptStream
from rl_engine.rewards import RewardSample, call_score, check_scores, score_metrics


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


class TaskScorer:
    """The built-in task's reward: task.rewards(prompt indices, completion token ids, step)."""

    def __init__(self, task):
        self.task = task

    def score(self, records, completions, step: int) -> tuple[list[float], dict[str, float]]:
        rewards = self.task.rewards(
            [c.prompt_index for c in completions], [c.token_ids for c in completions], step
        )
        return list(rewards), {}


class DriverRewards:
    """Scores samples one after another in the driver, each under reward.timeout_s."""

    def __init__(self, fn, kwargs: dict, timeout_s: float):
        self.fn, self.kwargs, self.timeout_s = fn, kwargs, timeout_s

    def score(self, samples: list[RewardSample]):
        return [call_score(self.fn, s, self.kwargs, self.timeout_s) for s in samples]

    def close(self) -> None:
        pass


class FunctionScorer:
    """A verl compute_score over decoded completions; `runner` is DriverRewards or a RewardPool."""

    def __init__(self, runner, tokenizer, on_error: str, prefix: str = "reward/"):
        self.runner, self.tokenizer, self.on_error, self.prefix = (
            runner,
            tokenizer,
            on_error,
            prefix,
        )

    def samples(self, records: list[PromptRecord], completions) -> list[RewardSample]:
        out = []
        for c in completions:
            record = records[c.prompt_index]
            out.append(
                RewardSample(
                    data_source=record.data_source,
                    solution_str=self.decode(c.token_ids),
                    ground_truth=record.ground_truth,
                    extra_info=record.extra_info,
                    where=f"prompt {record.where or c.prompt_index}, sample {c.sample_index}",
                )
            )
        return out

    def decode(self, token_ids) -> str:
        """verl's solution_str: the completion decoded without special tokens (no tokenizer:
        the token ids joined by spaces)."""
        if self.tokenizer is None:
            return " ".join(str(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def score_all(self, records, completions):
        """(Scores, samples) of `completions`; under on_error 'fail' a bad one raises RewardFailure."""
        samples = self.samples(records, completions)
        scores = self.runner.score(samples)
        check_scores(scores, samples, self.on_error, "the reward")
        return scores, samples

    def score(self, records, completions, step: int) -> tuple[list[float], dict[str, float]]:
        scores, _ = self.score_all(records, completions)
        return [s.value for s in scores], score_metrics(scores, self.prefix)


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
