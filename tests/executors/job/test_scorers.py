"""How a step's completions are scored: the task's own reward unless a verl reward function or
a dataset is configured (never with an environment), a reward function called on the decoded
completion with the record's ground truth, its raises counted under reward/ (scored 0) or, under
on_error 'fail', a RewardFailure naming the prompt's file and row and the sample."""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.data import PromptRecord
from rl_engine.data.tasks import make_task
from rl_engine.executors.job.scorers import (
    DriverRewards,
    FunctionScorer,
    TaskScorer,
    reward_runner,
    scores_with_reward_function,
    step_scorer,
    trains_on_reward_function,
)
from rl_engine.rewards.scoring import RewardFailure
from rl_engine.rollout import Completion


def exact_answer(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    """A verl compute_score: 1 (+ bonus) when the decoded completion is the answer."""
    if solution_str == "13":
        raise ValueError("unlucky completion")
    return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str)}


def completion(prompt_index: int, sample_index: int, tokens: list[int]) -> Completion:
    return Completion([1], tokens, torch.zeros(len(tokens)), "stop", 0, prompt_index, sample_index)


RECORDS = [
    PromptRecord(messages=[], ground_truth="4 2", data_source="d", file="train.jsonl", row=3)
]


def test_which_reward_trains_and_which_validates():
    assert not trains_on_reward_function(RunConfig())
    assert not scores_with_reward_function(RunConfig())
    assert trains_on_reward_function(RunConfig.from_dict({"reward": {"function": "gsm8k"}}))
    validation_only = RunConfig.from_dict({"data": {"val_files": "val.jsonl"}})
    assert not trains_on_reward_function(validation_only)
    assert scores_with_reward_function(validation_only)


def test_the_default_run_scores_with_its_task_and_needs_no_runner():
    config = RunConfig()
    task = make_task("count", vocab_size=64)
    assert reward_runner(config) is None
    scorer = step_scorer(config, task, None, None)
    assert isinstance(scorer, TaskScorer)
    done = [completion(0, 0, [1, 2, 60, 61])]  # band [0, 8): two of four tokens
    assert scorer.score([], done, step=0) == ([0.5], {})


def test_a_reward_function_scores_decoded_completions_with_their_ground_truth():
    runner = DriverRewards(exact_answer, {"bonus": 0.5}, timeout_s=5.0)
    scorer = FunctionScorer(runner, tokenizer=None, on_error="zero")
    done = [completion(0, 0, [4, 2]), completion(0, 1, [4]), completion(0, 2, [13])]
    rewards, metrics = scorer.score(RECORDS, done, step=0)
    assert rewards == [1.5, 0.5, 0.0]
    assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 0.0
    assert metrics["reward/extra/length"] == (3 + 1) / 2  # the raising sample has no extras


def test_on_error_fail_names_the_prompts_row_and_the_sample():
    scorer = FunctionScorer(DriverRewards(exact_answer, {}, 5.0), None, on_error="fail")
    with pytest.raises(RewardFailure, match=r"train.jsonl row 3, sample 1 \(data_source 'd'\)"):
        scorer.score(RECORDS, [completion(0, 0, [4, 2]), completion(0, 1, [13])], step=0)


def test_on_error_fail_names_the_prompt_index_of_a_record_made_in_code():
    """A task's or rollout.source's record has no file: the error names the prompt's index."""
    made = [PromptRecord(messages=[], ground_truth="x", data_source="d")] * 3
    scorer = FunctionScorer(DriverRewards(exact_answer, {}, 5.0), None, on_error="fail")
    with pytest.raises(RewardFailure, match=r"prompt 2, sample 1 \(data_source 'd'\)"):
        scorer.score(made, [completion(2, 0, [4]), completion(2, 1, [13])], step=0)
