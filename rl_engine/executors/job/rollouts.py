"""The step's rollouts stage: a step's completions and their rewards, and where they are saved.

By default the rollout engines generate them (`StepGeneration`: the step's prompts spread
over the engines, sampled with the step's seeds, `step_sampling`) and the scorer scores
them. With `rollout.source` (a rollout file, or a folder of `step_N.jsonl` files; see
docs/rollouts.md) the job trains on that source's completions instead: its GRPO
groups are served `rollout.prompts_per_step` at a time, in file order, starting
over at the end; each group must hold `rollout.samples_per_prompt` completions,
and all lines one `logprob_temperature` (the trainer scores at it). A
completion's reward is the file's, or the task's when its line has none; the
file's `weight_version`s are dropped (they count another trainer's updates). With `rollout.save` every step's completions and
rewards go to `output_dir/rollouts/step_N.jsonl`.

With `rollout.env` each sample is an episode (episodes.py): generation takes the round's
prompt records (the environment's reset reads their answer and extra_info) and every episode
carries its reward, so the scorer is not asked; the env/* figures of the step's episodes join
the metrics.

DAPO's rules: `algorithm.overlong_penalty` adds the soft overlong punishment to every
completion's reward; `rollout.filter_groups` drops the groups whose rewards are all equal
and runs more generation rounds of `prompts_per_step` prompts until that many groups are
kept, at most `rollout.filter_groups_max_tries` rounds (then the dropped groups fill the
rest, in order: `rollout/filter_filled`). Round 0 is the step as it would be unfiltered;
round k draws a built-in task's prompts from `prompt_key(step, k)` and samples with seeds
from (seed, step, k), and a dataset's prompts are the stream's next ones (its cursor is
checkpointed), so a resumed run repeats every round. That is why this stage takes the
prompt source and the engines rather than one list of prompts: a round draws its own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rl_engine.config import RunConfig
from rl_engine.envs import episode_metrics
from rl_engine.envs.files import parse_episode_rollouts, write_episodes
from rl_engine.executors.job.faults import ActorInfo, gather
from rl_engine.executors.job.prompts import TaskPrompts, prompt_key, records_of_source
from rl_engine.executors.job.scorers import TaskScorer
from rl_engine.executors.job.step_metrics import StepClock
from rl_engine.rollout import Completion, RolloutFileError

log = logging.getLogger("rl_engine.job")

# (prompts[, attempt]) -> completions, prompt-major; attempt > 0: a later round of the step
Generate = Callable[..., list[Completion]]


class StepRollouts:
    """`rollouts(step, generate)` -> (completions, rewards, metrics) of one step, saved when configured.

    `generate` is the step's generation (`StepGeneration` on the engines; never called with
    `rollout.source`). `prompts` (prompts.TaskPrompts / DatasetPrompts; default: the built-in
    `task`'s) gives each round's prompts and `scorer` (scorers.TaskScorer / FunctionScorer;
    default: the task's reward) their rewards; `metrics` are the scorer's (`reward/*`) and the
    dataset's (`data/*`), empty for a built-in task.
    """

    def __init__(self, config: RunConfig, task, vocab_size: int, *, prompts=None, scorer=None):
        self.config = config
        self.prompts = TaskPrompts(task) if prompts is None else prompts
        self.scorer = TaskScorer(task) if scorer is None else scorer
        source = config.rollout.source
        self.groups = None if source is None else load_groups(config, vocab_size)
        self.save_dir = Path(config.output_dir) / "rollouts" if config.rollout.save else None

    def __call__(self, step: int, generate: Generate, clock=None):
        if self.groups is not None:
            completions = self._from_source(step)
            rewards, metrics = self._rewards(None, completions, step, clock)
            rewards, shaping = self._shaped(completions, rewards)
            metrics.update(shaping)
        elif self.config.rollout.filter_groups:
            completions, rewards, metrics = self._filtered(step, generate, clock)
        else:
            completions, rewards, metrics = self._attempt(step, 0, generate, clock)
        if self.config.rollout.env is not None:
            metrics.update(episode_metrics(completions))
        if self.save_dir is not None:
            saved = [replace(c, reward=r) for c, r in zip(completions, rewards)]
            write_episodes(self.save_dir / f"step_{step}.jsonl", saved)
        return completions, rewards, metrics

    def _attempt(self, step: int, attempt: int, generate: Generate, clock):
        """One generation round: the prompts of (step, attempt), their completions and rewards
        (shaped). Round 0 is the step itself; later rounds (filter_groups) draw other prompts
        and sampling seeds, all a function of (seed, step, attempt) or of the stream cursor."""
        key = prompt_key(step, attempt)
        records = self.prompts.take(key, self.config.rollout.prompts_per_step)
        metrics = dict(self.prompts.metrics(records))
        # an environment's episodes start from the records (reset reads answer, extra_info)
        inputs = records if self.config.rollout.env else [r.prompt_ids for r in records]
        completions = generate(inputs) if attempt == 0 else generate(inputs, attempt)
        rewards, reward_metrics = self._rewards(records, completions, key, clock)
        rewards, shaping = self._shaped(completions, rewards)
        return completions, rewards, {**metrics, **reward_metrics, **shaping}

    def _filtered(self, step: int, generate: Generate, clock):
        """DAPO's dynamic sampling: rounds of prompts_per_step prompts until as many groups with
        unequal rewards are kept (at most rollout.filter_groups_max_tries rounds; then the
        dropped groups fill the rest, in order). Groups keep their round order, renumbered."""
        r = self.config.rollout
        kept, dropped, metrics, tries = [], [], {}, 0
        while len(kept) < r.prompts_per_step and tries < r.filter_groups_max_tries:
            completions, rewards, round_metrics = self._attempt(step, tries, generate, clock)
            tries += 1
            _merge_round_metrics(metrics, round_metrics)
            for group in _groups_of(completions, rewards):
                values = [reward for _, reward in group]
                (kept if max(values) > min(values) else dropped).append(group)
        filled = max(r.prompts_per_step - len(kept), 0)
        chosen = (kept + dropped[:filled])[: r.prompts_per_step]
        completions = [
            replace(c, prompt_index=i) for i, group in enumerate(chosen) for c, _ in group
        ]
        rewards = [reward for group in chosen for _, reward in group]
        metrics.update(
            {
                "rollout/filter_tries": float(tries),
                "rollout/filter_dropped": float(len(dropped)),
                "rollout/filter_filled": float(filled),
            }
        )
        if filled:
            log.warning(
                "step %d: rollout.filter_groups kept %d of %d groups after %d tries "
                "(rollout.filter_groups_max_tries); %d groups with equal rewards fill the rest",
                step,
                len(kept),
                r.prompts_per_step,
                tries,
                filled,
            )
        return completions, rewards, metrics

    def _shaped(self, completions: list[Completion], rewards: list[float]):
        """Rewards plus algorithm.overlong_penalty (when set) and its mean as a metric."""
        penalty = self.config.algorithm.overlong_penalty
        if penalty is None:
            return rewards, {}
        import torch

        from rl_engine.algorithms import overlong_penalty

        lengths = torch.tensor([len(c.token_ids) for c in completions])
        shaping = overlong_penalty(
            lengths,
            max_length=self.config.rollout.max_new_tokens,
            buffer=penalty["buffer"],
            factor=float(penalty["factor"]),
        ).tolist()
        shaped = [reward + extra for reward, extra in zip(rewards, shaping)]
        return shaped, {"reward/overlong_penalty": sum(shaping) / len(shaping)}

    def _from_source(self, step: int) -> list[Completion]:
        """Groups [step * P, (step + 1) * P) of the source (modulo its size), renumbered 0..P-1."""
        per_step = self.config.rollout.prompts_per_step
        first = step * per_step
        if first // len(self.groups) != (first + per_step - 1) // len(self.groups):
            log.info("rollout.source: step %d starts another pass over the source", step)
        picked = [self.groups[(first + i) % len(self.groups)] for i in range(per_step)]
        return [replace(c, prompt_index=i) for i, group in enumerate(picked) for c in group]

    def _rewards(self, records, completions: list[Completion], step: int, clock=None):
        """The rollout file's rewards where it has them, the scorer's for the rest."""
        started = time.perf_counter()
        missing = [i for i, c in enumerate(completions) if c.reward is None]
        rewards = [c.reward for c in completions]
        metrics: dict[str, float] = {}
        if missing:
            if records is None:
                records = records_of_source(completions)
            scored, metrics = self.scorer.score(records, [completions[i] for i in missing], step)
            for i, reward in zip(missing, scored):
                rewards[i] = reward
        if clock is not None:
            clock.add("reward", time.perf_counter() - started)
        return rewards, dict(metrics)


@dataclass
class StepGeneration:
    """Generation of step `step` on the engines, as `StepRollouts` calls it: (prompts of round
    `attempt`) -> their completions in prompt order, sampled with the round's seeds
    (`step_sampling`); the slowest engine's own seconds go to the clock's generate_compute."""

    engines: list[ActorInfo]
    config: RunConfig
    step: int
    eos_token_id: object
    clock: StepClock

    def __call__(self, prompts: list[list[int]], attempt: int = 0) -> list[Completion]:
        sampling = step_sampling(self.config, self.step, self.eos_token_id, attempt)
        completions, seconds = generate_on_engines(self.engines, prompts, sampling)
        self.clock.add("generate_compute", seconds)
        return completions


def generate_on_engines(
    engines: list[ActorInfo], prompts: list[list[int]], sampling, *, after_env_turn: bool = False
):
    """Prompts spread over the engines: (completions in prompt order, the slowest engine's
    seconds). Every TP rank of an engine gets its engine's prompts; its rank 0 answers.
    `sampling`: one SamplingParams for every engine, or a list of one per engine.
    `after_env_turn`: the prompts continue transcripts after an environment turn (no prefill
    sharing: a group's transcripts have diverged)."""
    count = len(engine_leads(engines))
    per_engine = sampling if isinstance(sampling, list) else [sampling] * count
    shards = [list(range(i, len(prompts), count)) for i in range(count)]
    calls = [
        (
            e,
            e.handle.generate.remote(
                [prompts[j] for j in shards[e.rank]], per_engine[e.rank], after_env_turn
            ),
        )
        for e in engines
    ]
    answers = [answer for e, answer in zip(engines, gather(calls)) if not e.tp_rank]
    completions, seconds = [], 0.0
    for idx, (result, spent) in zip(shards, answers):
        seconds = max(seconds, spent)
        for c in result:
            c.prompt_index = idx[c.prompt_index]
            completions.append(c)
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    return completions, seconds


def engine_leads(engines: list[ActorInfo]) -> list[ActorInfo]:
    """One process per engine (its TP rank 0): the engines as the driver counts them."""
    return [e for e in engines if not e.tp_rank]


def step_sampling(config: RunConfig, step: int, eos_token_id, attempt: int = 0):
    """The step's SamplingParams: the config's, seeded from (seed, step) so a resumed run repeats
    it; a later generation round of the step (rollout.filter_groups) from (seed, step, attempt)."""
    from rl_engine.rollout import SamplingParams

    seed = config.seed * 100_003 + step
    if attempt:
        text = f"filter/{config.seed}/{step}/{attempt}"
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    return SamplingParams.from_config(config.rollout, seed=seed, eos_token_id=eos_token_id)


def _groups_of(completions: list[Completion], rewards: list[float]):
    """[(completion, reward), ...] per prompt, in order of the prompts' first completion."""
    groups: dict[int, list] = {}
    for c, reward in zip(completions, rewards):
        groups.setdefault(c.prompt_index, []).append((c, reward))
    return list(groups.values())


def _merge_round_metrics(total: dict, round_metrics: dict) -> None:
    """Counts (errors, timeouts, filtered) add up over the rounds; other figures keep round 0's."""
    for key, value in round_metrics.items():
        if key.endswith(("errors", "timeouts")) and key in total:
            total[key] += value
        else:
            total.setdefault(key, value)


def load_groups(config: RunConfig, vocab_size: int) -> list[list[Completion]]:
    """The source's GRPO groups in file order; ValueError naming the line for anything unusable.
    Multi-turn lines keep their policy_mask (the environment's tokens are never trained on)."""
    r = config.rollout
    parsed = parse_episode_rollouts(r.source, vocab_size=vocab_size)
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
