"""The step's prompt sources: a built-in task's prompts as records carrying its answers, the
key of a resampling round (never a step's own key), a dataset stream whose cursor moves by
what each step took and is restored from a checkpoint (or from the step for an old one), and
records rebuilt for completions read from rollout.source."""

from __future__ import annotations

import torch

from rl_engine.config import RunConfig
from rl_engine.data import PromptDataset, PromptRecord, PromptStream
from rl_engine.data.tasks import make_task
from rl_engine.executors.job.prompts import (
    DatasetPrompts,
    TaskPrompts,
    prompt_key,
    records_of_source,
    run_prompts,
)
from rl_engine.rollout import Completion


def test_task_prompts_are_the_tasks_own_with_its_name():
    task = make_task("count", vocab_size=64, seed=3)
    records = TaskPrompts(task).take(5, 2)
    assert [r.prompt_ids for r in records] == task.prompts(2, 5)
    assert {r.data_source for r in records} == {"count"}
    assert [r.ground_truth for r in records] == [None, None]  # count has no answers


def test_without_train_files_the_run_uses_its_task():
    task = make_task("count", vocab_size=64)
    source = run_prompts(RunConfig(), task, tokenizer=None)
    assert isinstance(source, TaskPrompts) and source.task is task
    assert source.state() == {} and source.metrics([]) == {}


def test_prompt_key_is_the_step_for_round_0_and_a_distinct_negative_key_after():
    assert prompt_key(7, 0) == 7
    retries = [prompt_key(7, attempt) for attempt in (1, 2, 3)] + [prompt_key(8, 1)]
    assert all(key < 0 for key in retries)
    assert len(set(retries)) == 4
    assert prompt_key(7, 1) == prompt_key(7, 1)


def rows(n: int) -> PromptDataset:
    return PromptDataset(
        [
            PromptRecord(messages=[], ground_truth=i, data_source="d", prompt_ids=[i])
            for i in range(n)
        ]
    )


def test_dataset_cursor_moves_by_what_was_taken_and_is_restored():
    source = DatasetPrompts(PromptStream(rows(5), seed=0, shuffle=False), prompts_per_step=2)
    assert [r.ground_truth for r in source.take(0, 2)] == [0, 1]
    assert [r.ground_truth for r in source.take(0, 3)] == [2, 3, 4]  # a resampling round
    assert source.state() == {"prompt_position": 5}
    assert [r.ground_truth for r in source.take(1, 2)] == [0, 1]  # the second epoch
    assert source.metrics([])["data/epoch"] == 1.0
    source.restore({"prompt_position": 3}, step=9)
    assert source.position == 3
    source.restore({}, step=4)  # a checkpoint from before the cursor: 2 prompts a step
    assert source.position == 8


def test_records_of_source_fill_every_prompt_index():
    def completion(prompt_index, prompt_ids):
        return Completion(prompt_ids, [1], torch.zeros(1), "length", None, prompt_index, 0)

    records = records_of_source([completion(2, [9, 8]), completion(0, [4])])
    assert [r.prompt_ids for r in records] == [[4], [], [9, 8]]
    assert {r.data_source for r in records} == {"rollout.source"}
    assert all(r.ground_truth is None for r in records)
