"""Validation during training: `data.val_files` sampled by the rollout engines and scored.

When (`due_before` / `due_after`): the initial policy before step 0 (`eval.before_train`),
after every `eval.every` steps, and after the last step. The figures go into the row
of the step they follow: the initial eval into step 0's row, the eval after step s into
step s's row, no extra rows. The eval after step 0 would share step 0's row with the
initial eval, so it is not run when the initial one is.

What it leaves untouched: the engines hold no state between `generate` calls but their
weights, the prompt stream's cursor is not moved, and eval samples with seeds of their
own (`eval_seed`, a hash of (seed, updates), never a training step's seed): a run with
eval on equals the run with eval off on every training metric.

Metrics (k = eval.samples_per_prompt), over the validation prompts:
- `eval/reward_mean`: mean score of all k x prompts completions;
- `eval/mean@k`: mean over prompts of the mean of its k scores;
- `eval/pass@k`: mean over prompts of the best of its k scores (0/1 rewards: the fraction
  solved by at least one sample); both also under the run's k (`eval/pass@4`), as verl
  names them;
- `eval/response_length`: mean completion tokens; `eval/num_prompts`;
- `eval/reward_errors`, `eval/reward_timeouts`;
- with several data_sources, the first four again per source: `eval/<source>/...`.

With `rollout.env` every validation sample is an episode with the environment (eval's
sampling, the run's limits); its reward is the episode's return, and `eval/reward_errors` /
`eval/reward_timeouts` count the episodes whose environment raised / timed out, and the
episodes' env/* figures come under `eval/env/`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict

from rl_engine.config import RunConfig
from rl_engine.data import PromptDataset
from rl_engine.envs import episode_metrics
from rl_engine.executors.job.faults import ActorInfo
from rl_engine.executors.job.prompts import load_prompt_files
from rl_engine.executors.job.rollouts import generate_on_engines
from rl_engine.executors.job.scorers import FunctionScorer
from rl_engine.rewards import Score

log = logging.getLogger("rl_engine.job")


def eval_seed(seed: int, updates: int) -> int:
    """The sampling seed of the eval of the policy after `updates` steps (63 bits, never a
    training step's small seed*100003 + step)."""
    digest = hashlib.blake2b(f"eval/{seed}/{updates}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def eval_metrics(records, completions, scores, k: int, prefix: str = "eval/") -> dict[str, float]:
    """The eval figures of completions (prompt-major, k per prompt) and their Scores."""
    by_prompt: dict[int, list[float]] = defaultdict(list)
    lengths = []
    for c, s in zip(completions, scores):
        by_prompt[c.prompt_index].append(s.value)
        lengths.append(len(c.token_ids))
    groups = list(by_prompt.values())
    metrics = {
        f"{prefix}reward_mean": sum(s.value for s in scores) / len(scores),
        f"{prefix}mean@k": sum(sum(g) / len(g) for g in groups) / len(groups),
        f"{prefix}pass@k": sum(max(g) for g in groups) / len(groups),
        f"{prefix}response_length": sum(lengths) / len(lengths),
    }
    metrics[f"{prefix}mean@{k}"] = metrics[f"{prefix}mean@k"]
    metrics[f"{prefix}pass@{k}"] = metrics[f"{prefix}pass@k"]
    return metrics


class Evaluator:
    """Runs the validation set on the rollout engines and scores it."""

    def __init__(
        self, config: RunConfig, dataset: PromptDataset, scorer, eos_token_id, episodes=None
    ):
        self.config, self.dataset, self.scorer = config, dataset, scorer
        self.eos_token_id = eos_token_id if isinstance(eos_token_id, int) else None
        self.episodes = episodes  # rollout.env's EpisodeRunner, or None

    def due_before(self, step: int) -> bool:
        return step == 0 and self.config.eval.before_train

    def due_after(self, step: int) -> bool:
        done, every = step + 1, self.config.eval.every
        if done == 1 and self.config.eval.before_train:
            return False  # step 0's row already holds the initial eval
        return done == self.config.steps or bool(every and done % every == 0)

    def sampling(self, updates: int):
        from rl_engine.rollout import SamplingParams

        e = self.config.eval
        return SamplingParams(
            max_new_tokens=e.max_new_tokens or self.config.rollout.max_new_tokens,
            temperature=e.temperature,
            n=e.samples_per_prompt,
            seed=eval_seed(self.config.seed, updates),
            eos_token_id=self.eos_token_id,
        )

    def run(self, engines: list[ActorInfo], updates: int) -> dict[str, float]:
        """Every validation prompt, k completions each; the figures of the policy after `updates` steps."""
        records = self.dataset.records
        k = self.config.eval.samples_per_prompt
        completions, scores = self.sample_and_score(engines, records, updates)
        metrics = eval_metrics(records, completions, scores, k)
        metrics["eval/num_prompts"] = float(len(records))
        metrics["eval/reward_errors"] = float(sum(1 for s in scores if s.error and not s.timed_out))
        metrics["eval/reward_timeouts"] = float(sum(1 for s in scores if s.timed_out))
        if self.episodes is not None:
            metrics.update({f"eval/{k}": v for k, v in episode_metrics(completions).items()})
        sources = self.dataset.data_sources
        if len(sources) > 1:
            for source in sources:
                picked = [
                    (c, s)
                    for c, s in zip(completions, scores)
                    if records[c.prompt_index].data_source == source
                ]
                metrics.update(
                    eval_metrics(
                        records,
                        [c for c, _ in picked],
                        [s for _, s in picked],
                        k,
                        f"eval/{source}/",
                    )
                )
        log.info(
            "eval after %d update(s): reward %.3f, pass@%d %.3f on %d prompts",
            updates,
            metrics["eval/reward_mean"],
            k,
            metrics["eval/pass@k"],
            len(records),
        )
        return metrics

    def sample_and_score(self, engines: list[ActorInfo], records, updates: int):
        """(completions, their Scores): the reward function's, or the episodes' returns."""
        sampling = self.sampling(updates)
        if self.episodes is not None:
            k = self.config.eval.samples_per_prompt
            episodes = self.episodes.run(records, k, engines, sampling)
            return episodes, [_episode_score(e) for e in episodes]
        prompts = [r.prompt_ids for r in records]
        completions, _ = generate_on_engines(engines, prompts, sampling)
        scores, _ = self.scorer.score_all(records, completions)
        return completions, scores


def _episode_score(episode) -> Score:
    """An episode's return as a Score, its environment's failures as an error or timeout."""
    failed = "the environment raised" if episode.env_errors else None
    if episode.env_timeouts:
        return Score(episode.reward, error="the environment timed out", timed_out=True)
    return Score(episode.reward, error=failed)


def build_evaluator(
    config: RunConfig, runner, tokenizer, eos_token_id, episodes=None
) -> Evaluator | None:
    """The Evaluator of `data.val_files` (tokenized with the engines' tokenizer, scored by the
    training reward's `runner` under `eval/`, or played as episodes with rollout.env's
    `episodes`); None without a validation set."""
    if config.data.val_files is None:
        return None
    val = load_prompt_files(config, "validation", tokenizer)
    scorer = (
        None if episodes else FunctionScorer(runner, tokenizer, config.reward.on_error, "eval/")
    )
    return Evaluator(config, val, scorer, eos_token_id, episodes)


def run_if_due(
    evaluator: Evaluator | None,
    engines: list[ActorInfo],
    step: int,
    clock,
    *,
    before: bool,
    updates: int,
):
    """Validation figures due before (step 0) or after `step`, timed as the clock's "eval"
    phase; {} when none is due (or the run has no validation set)."""
    if evaluator is None:
        return {}
    if not (evaluator.due_before(step) if before else evaluator.due_after(step)):
        return {}
    with clock.phase("eval"):
        return evaluator.run(engines, updates=updates)
