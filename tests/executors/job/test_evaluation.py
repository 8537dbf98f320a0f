"""Validation's schedule (which row holds which eval), its figures, and its seeds."""

from __future__ import annotations

import torch

from rl_engine.config import RunConfig
from rl_engine.data import PromptDataset, PromptRecord
from rl_engine.executors.job.evaluation import Evaluator, eval_metrics, eval_seed
from rl_engine.executors.job.rollouts import step_sampling
from rl_engine.rewards import Score
from rl_engine.rollout import Completion


def _config(steps: int, every: int, before_train: bool = True) -> RunConfig:
    return RunConfig.from_dict(
        {
            "steps": steps,
            "data": {"val_files": "val.parquet"},
            "eval": {"every": every, "before_train": before_train},
        }
    )


def _schedule(config: RunConfig) -> list[str]:
    evaluator = Evaluator(config, PromptDataset([]), scorer=None, eos_token_id=2)
    rows = []
    for step in range(config.steps):
        marks = ("before" if evaluator.due_before(step) else "") + (
            "after" if evaluator.due_after(step) else ""
        )
        rows.append(marks or "-")
    return rows


def test_each_eval_goes_into_the_row_of_the_step_it_follows():
    assert _schedule(_config(steps=7, every=3)) == [
        "before",
        "-",
        "after",
        "-",
        "-",
        "after",
        "after",
    ]
    assert _schedule(_config(steps=4, every=0)) == ["before", "-", "-", "after"]
    assert _schedule(_config(steps=3, every=1)) == ["before", "after", "after"]  # row 0: initial
    assert _schedule(_config(steps=3, every=1, before_train=False)) == ["after"] * 3
    assert _schedule(_config(steps=1, every=0, before_train=False)) == ["after"]


def _completion(prompt: int, sample: int, tokens: int) -> Completion:
    return Completion([1], [5] * tokens, torch.zeros(tokens), "length", 0, prompt, sample)


def test_pass_at_k_is_the_best_of_k_and_mean_at_k_the_mean():
    completions = [_completion(p, s, 2 + p) for p in range(3) for s in range(2)]
    scores = [Score(v) for v in (1.0, 0.0, 0.0, 0.0, 1.0, 1.0)]
    metrics = eval_metrics(None, completions, scores, k=2)
    assert metrics["eval/pass@k"] == metrics["eval/pass@2"] == 2 / 3
    assert metrics["eval/mean@k"] == metrics["eval/mean@2"] == 0.5
    assert metrics["eval/reward_mean"] == 0.5 and metrics["eval/response_length"] == 3.0


def test_eval_seeds_are_never_a_training_steps_seed():
    config = _config(steps=50, every=5)
    training = {step_sampling(config, s, None).seed for s in range(10_000)}
    evaluator = Evaluator(config, PromptDataset([PromptRecord([], "1", "x")]), None, 2)
    seeds = [evaluator.sampling(u).seed for u in range(51)]
    assert len(set(seeds)) == 51 and not training & set(seeds)
    assert seeds[3] == eval_seed(config.seed, 3)
