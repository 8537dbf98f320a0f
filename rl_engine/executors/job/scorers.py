"""How a step's completions are scored, whichever reward the config names.

Scorers (`score(records, completions, key)` -> (rewards, metrics); `step_scorer` picks the
config's):
- `TaskScorer`: the built-in task's own reward (no metrics: old runs log what they did);
- `FunctionScorer`: a verl compute_score (`reward.function`, or by data_source when a
  dataset is set) on the decoded completion, in the driver (`DriverRewards`) or the Ray
  reward workers (`reward_workers.RewardPool`); raises and timeouts are counted under
  `reward/` and scored 0, or fail the step. Validation scores with the same runner.
"""

from __future__ import annotations

import logging

from rl_engine.config import RunConfig
from rl_engine.data import PromptRecord
from rl_engine.rewards import (
    RewardSample,
    call_score,
    check_scores,
    load_reward_function,
    score_metrics,
)

log = logging.getLogger("rl_engine.job")


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


def trains_on_reward_function(config: RunConfig) -> bool:
    """A verl-style reward scores the training completions (reward.function or a dataset);
    else the built-in task's own reward does (validation always uses the function). With
    rollout.env neither: the environment rewards its episodes."""
    if config.rollout.env is not None:
        return False
    return config.reward.function is not None or config.data.train_files is not None


def scores_with_reward_function(config: RunConfig) -> bool:
    """The verl reward scores training or validation completions (not with rollout.env)."""
    evaluates = config.data.val_files is not None and config.rollout.env is None
    return trains_on_reward_function(config) or evaluates


def reward_runner(config: RunConfig):
    """What runs the verl reward (DriverRewards, or `reward.num_workers` Ray workers), when the
    training completions or a validation set are scored with it; else None. The caller closes it."""
    if not scores_with_reward_function(config):
        return None
    r = config.reward
    if r.num_workers == 0:
        return DriverRewards(load_reward_function(r.function, r.kwargs), r.kwargs, r.timeout_s)
    from rl_engine.executors.job.reward_workers import RewardPool
    from rl_engine.rewards.loading import absolute_spec

    log.info("starting %d reward worker(s)", r.num_workers)
    return RewardPool(absolute_spec(r.function), r.kwargs, r.timeout_s, r.num_workers)


def step_scorer(config: RunConfig, task, runner, tokenizer) -> TaskScorer | FunctionScorer:
    """The training completions' scorer: the verl reward (through `runner`) or the task's own."""
    if trains_on_reward_function(config):
        return FunctionScorer(runner, tokenizer, config.reward.on_error)
    return TaskScorer(task)
