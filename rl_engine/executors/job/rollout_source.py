"""Where a job step's completions and rewards come from, and where they are saved.

By default the rollout engines generate them and the task scores them. With
`rollout.source` (a rollout file, or a folder of `step_N.jsonl` files; see
docs/rollouts.md) the job trains on that source's completions instead: its GRPO
groups are served `rollout.prompts_per_step` at a time, in file order, starting
over at the end; each group must hold `rollout.samples_per_prompt` completions,
and all lines one `logprob_temperature` (the trainer scores at it). A
completion's reward is the file's, or the task's when its line has none; the
file's `weight_version`s are dropped (they count another trainer's updates). With `rollout.save` every step's completions and
rewards go to `output_dir/rollouts/step_N.jsonl`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rl_engine.config import RunConfig
from rl_engine.rollout import Completion, RolloutFileError, write_rollouts
from rl_engine.rollout.files import parse_rollouts

log = logging.getLogger("rl_engine.job")

Generate = Callable[[list[list[int]]], list[Completion]]  # prompts -> completions, prompt-major


class StepRollouts:
    """`rollouts(step, generate)` -> (completions, rewards, metrics) of one step, saved when configured.

    `prompts` (step_prompts.TaskPrompts / DatasetPrompts; default: the built-in `task`'s)
    gives the step's prompts and `scorer` (TaskScorer / FunctionScorer; default: the task's
    reward) their rewards; `metrics` are the scorer's
    (`reward/*`) and the dataset's (`data/*`), empty for a built-in task.
    """

    def __init__(self, config: RunConfig, task, vocab_size: int, *, prompts=None, scorer=None):
        from rl_engine.executors.job.step_prompts import TaskPrompts, TaskScorer

        self.config = config
        self.prompts = TaskPrompts(task) if prompts is None else prompts
        self.scorer = TaskScorer(task) if scorer is None else scorer
        source = config.rollout.source
        self.groups = None if source is None else load_groups(config, vocab_size)
        self.save_dir = Path(config.output_dir) / "rollouts" if config.rollout.save else None

    def __call__(self, step: int, generate: Generate, clock=None):
        metrics: dict[str, float] = {}
        if self.groups is None:
            records = self.prompts.take(step, self.config.rollout.prompts_per_step)
            metrics.update(self.prompts.metrics(records))
            completions = generate([r.prompt_ids for r in records])
        else:
            completions, records = self._from_source(step), None
        started = time.perf_counter()
        rewards, reward_metrics = self._rewards(records, completions, step)
        if clock is not None:
            clock.add("reward", time.perf_counter() - started)
        metrics.update(reward_metrics)
        if self.save_dir is not None:
            saved = [replace(c, reward=r) for c, r in zip(completions, rewards)]
            write_rollouts(self.save_dir / f"step_{step}.jsonl", saved)
        return completions, rewards, metrics

    def _from_source(self, step: int) -> list[Completion]:
        """Groups [step * P, (step + 1) * P) of the source (modulo its size), renumbered 0..P-1."""
        per_step = self.config.rollout.prompts_per_step
        first = step * per_step
        if first // len(self.groups) != (first + per_step - 1) // len(self.groups):
            log.info("rollout.source: step %d starts another pass over the source", step)
        picked = [self.groups[(first + i) % len(self.groups)] for i in range(per_step)]
        return [replace(c, prompt_index=i) for i, group in enumerate(picked) for c in group]

    def _rewards(self, records, completions: list[Completion], step: int):
        """The rollout file's rewards where it has them, the scorer's for the rest."""
        missing = [i for i, c in enumerate(completions) if c.reward is None]
        rewards = [c.reward for c in completions]
        metrics: dict[str, float] = {}
        if missing:
            if records is None:
                from rl_engine.executors.job.step_prompts import records_of_source

                records = records_of_source(completions)
            scored, metrics = self.scorer.score(records, [completions[i] for i in missing], step)
            for i, reward in zip(missing, scored):
                rewards[i] = reward
        return rewards, metrics


def step_sampling(config: RunConfig, step: int, eos_token_id):
    """The step's SamplingParams: the config's, seeded from (seed, step) so a resumed run repeats it."""
    from rl_engine.rollout import SamplingParams

    seed = config.seed * 100_003 + step
    return SamplingParams.from_config(config.rollout, seed=seed, eos_token_id=eos_token_id)


def train_batch(config: RunConfig, completions: list[Completion], rewards: list[float], eos):
    """The step's TrainBatch, padded with EOS; its advantages are `algorithm.advantage`'s
    (rl_engine.algorithms.compute_advantages) over the prompts' groups."""
    from rl_engine.executors.worker.batch import TrainBatch

    algo = config.algorithm
    return TrainBatch.from_completions(
        completions,
        rewards,
        samples_per_prompt=config.rollout.samples_per_prompt,
        pad_token_id=eos if isinstance(eos, int) else 0,
        normalize_std=algo.normalize_std,
        advantage=algo.advantage,
        gamma=algo.gamma,
    )


def load_groups(config: RunConfig, vocab_size: int) -> list[list[Completion]]:
    """The source's GRPO groups in file order; ValueError naming the line for anything unusable."""
    r = config.rollout
    parsed = parse_rollouts(r.source, vocab_size=vocab_size)
    if parsed.bad_lines:
        raise RolloutFileError(parsed.bad_lines)
    groups: dict[int, list[Completion]] = {}
    where: dict[int, str] = {}
    temperature = parsed.completions[0].logprob_temperature
    for c, (file, line) in zip(parsed.completions, parsed.sources):
        if c.logprob_temperature != temperature:
            raise ValueError(
                f"rollout.source {file}:{line}: logprob_temperature {c.logprob_temperature} but the "
                f"source's first line has {temperature} (the trainer scores a step at one temperature)"
            )
        groups.setdefault(c.prompt_index, []).append(replace(c, weight_version=None))
        where.setdefault(c.prompt_index, f"{file}:{line}")
    for key, group in groups.items():
        if len(group) != r.samples_per_prompt:
            raise ValueError(
                f"rollout.source: the group starting at {where[key]} has {len(group)} completions "
                f"but rollout.samples_per_prompt is {r.samples_per_prompt} (the GRPO group size)"
            )
    if len(groups) < r.prompts_per_step:
        raise ValueError(
            f"rollout.source {r.source!r} holds {len(groups)} groups, fewer than "
            f"rollout.prompts_per_step = {r.prompts_per_step}"
        )
    return list(groups.values())
