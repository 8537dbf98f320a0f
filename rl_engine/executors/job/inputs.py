"""What the job's steps read, built once the engines have reported their model facts.

- the step's prompts: `data.train_files` (a seeded PromptStream) or the built-in
  `rollout.task`;
- its rewards: `reward.function` (or, with a dataset, the reward by data_source) run in
  the driver or in `reward.num_workers` Ray workers; else the task's own reward;
- the validation set (`data.val_files`) and its Evaluator, scored by the same function.

Datasets are tokenized here, with the tokenizer the engines loaded (reading it from a
GGUF file alone takes longer than starting the actors); the files themselves were
checked before Ray started (preflight).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rl_engine.config import RunConfig
from rl_engine.executors.job.evaluation import Evaluator
from rl_engine.executors.job.rollout_source import StepRollouts

log = logging.getLogger("rl_engine.job")


@dataclass
class JobInputs:
    rollouts: StepRollouts
    evaluator: Evaluator | None
    runner: object | None
    """The reward runner (DriverRewards or RewardPool) to close at the end, if any."""

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def trains_on_reward_function(config: RunConfig) -> bool:
    """A verl-style reward scores the training completions (reward.function or a dataset);
    else the built-in task's own reward does (validation always uses the function)."""
    return config.reward.function is not None or config.data.train_files is not None


def build_inputs(config: RunConfig, info: dict) -> JobInputs:
    """Prompts, scorer and evaluator of the run; `info` = the engines' vocab_size, eos, tokenizer."""
    from rl_engine.data import PromptStream, load_dataset
    from rl_engine.executors.job.step_prompts import DatasetPrompts, FunctionScorer, TaskPrompts
    from rl_engine.tasks import make_task

    tokenizer, vocab = info["tokenizer"], info["vocab_size"]
    task = make_task(config.rollout.task, vocab_size=vocab, tokenizer=tokenizer, seed=config.seed)
    runner = scorer = None
    if trains_on_reward_function(config) or config.data.val_files is not None:
        runner = _reward_runner(config)
    if trains_on_reward_function(config):
        scorer = FunctionScorer(runner, tokenizer, config.reward.on_error)
    prompts = None
    if config.data.train_files is not None:
        train = load_dataset(
            config.data.train_files, config.data, tokenizer, key="data.train_files"
        )
        _log_dataset("train", train, config)
        prompts = DatasetPrompts(
            PromptStream(train, seed=config.seed, shuffle=config.data.shuffle),
            config.rollout.prompts_per_step,
        )
    elif scorer is not None:
        prompts = TaskPrompts(task)
    rollouts = StepRollouts(config, task, vocab, prompts=prompts, scorer=scorer)
    evaluator = None
    if config.data.val_files is not None:
        val = load_dataset(config.data.val_files, config.data, tokenizer, key="data.val_files")
        _log_dataset("validation", val, config)
        eval_scorer = FunctionScorer(runner, tokenizer, config.reward.on_error, "eval/")
        evaluator = Evaluator(config, val, eval_scorer, info["eos_token_id"])
    return JobInputs(rollouts, evaluator, runner)


def _reward_runner(config: RunConfig):
    from rl_engine.executors.job.step_prompts import DriverRewards
    from rl_engine.rewards import load_reward_function

    r = config.reward
    if r.num_workers == 0:
        return DriverRewards(load_reward_function(r.function, r.kwargs), r.kwargs, r.timeout_s)
    from rl_engine.executors.job.reward_workers import RewardPool
    from rl_engine.rewards.loading import absolute_spec

    log.info("starting %d reward worker(s)", r.num_workers)
    return RewardPool(absolute_spec(r.function), r.kwargs, r.timeout_s, r.num_workers)


def _log_dataset(what: str, dataset, config: RunConfig) -> None:
    lengths = [len(r.prompt_ids) for r in dataset.records]
    log.info(
        "%s prompts: %d (longest %d tokens; over data.max_prompt_length = %d: %d filtered, "
        "%d truncated), data sources %s",
        what,
        len(dataset),
        max(lengths),
        config.data.max_prompt_length,
        dataset.filtered,
        dataset.truncated,
        ", ".join(dataset.data_sources),
    )
