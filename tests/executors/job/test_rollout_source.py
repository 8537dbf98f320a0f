"""rollout.source / rollout.save / rollout correction config, and how a job step reads a rollout source."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.job.rollouts import StepRollouts
from rl_engine.rollout import RolloutFileError, read_rollouts
from rl_engine.data.tasks import CountTask

VOCAB = 1000


def _config(tmp_path, source, **rollout):
    return RunConfig.from_dict(
        {
            "model": "tiny-llama",
            "output_dir": str(tmp_path / "run"),
            "rollout": {
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "source": str(source),
                **rollout,
            },
        }
    )


def _line(prompt, tokens, **extra):
    return json.dumps(
        {"prompt_token_ids": prompt, "token_ids": tokens, "logprobs": [-1.0] * len(tokens), **extra}
    )


def _source(tmp_path, lines):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GROUPS = [  # three groups of two; group 1 has no rewards (the task scores it)
    _line([5, 6], [7, 8], reward=1.0, weight_version=4),
    _line([5, 6], [9], reward=0.0, weight_version=4),
    _line([10], [1, 999]),
    _line([10], [2]),
    _line([11], [3], reward=0.5, prompt_index=9),
    _line([11], [4], reward=0.25, prompt_index=9),
]


def test_config_defaults_and_errors():
    plain = RunConfig()
    assert plain.parity == "strict" and plain.rollout.source is None and plain.rollout.save is False
    assert (
        plain.algorithm.rollout_correction == "none" and plain.algorithm.correction_threshold == 2.0
    )
    sourced = RunConfig.from_dict({"rollout": {"source": "r.jsonl"}})
    assert sourced.parity == "report", "another engine's logprobs are rarely bitwise equal"
    assert (
        RunConfig.from_dict({"parity": "strict", "rollout": {"source": "r.jsonl"}}).parity
        == "strict"
    )
    bad = [
        (
            {"algorithm": {"rollout_correction": "tis"}},
            r"algorithm\.rollout_correction must be one of \['none'",
        ),
        (
            {"algorithm": {"correction_threshold": 1.0}},
            r"algorithm\.correction_threshold must be a finite number > 1",
        ),
        ({"rollout": {"save": "yes"}}, r"rollout\.save must be true or false"),
        ({"rollout": {"source": ""}}, r"rollout\.source must be a non-empty string"),
    ]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            RunConfig.from_dict(data)


def test_steps_serve_groups_in_order_with_file_or_task_rewards_and_are_saved(tmp_path):
    config = _config(tmp_path, _source(tmp_path, GROUPS), save=True)
    task = CountTask(vocab_size=VOCAB)
    rollouts = StepRollouts(config, task, VOCAB)
    step0, rewards0, _ = rollouts(0, generate=None)
    assert [(c.prompt_ids, c.prompt_index, c.sample_index) for c in step0] == [
        ([5, 6], 0, 0),
        ([5, 6], 0, 1),
        ([10], 1, 0),
        ([10], 1, 1),
    ]
    task_rewards = task.rewards([1, 1], [[1, 999], [2]], 0)
    assert rewards0 == [1.0, 0.0, *task_rewards] and task_rewards == [0.5, 1.0]
    assert all(c.weight_version is None for c in step0), "the file's versions are not the worker's"
    step1, rewards1, _ = rollouts(1, generate=None)  # groups 2 and 0: the source starts over
    assert [c.prompt_ids for c in step1] == [[11], [11], [5, 6], [5, 6]] and rewards1 == [
        0.5,
        0.25,
        1.0,
        0.0,
    ]
    saved = read_rollouts(tmp_path / "run" / "rollouts" / "step_0.jsonl")
    assert [c.reward for c in saved] == rewards0 and [c.token_ids for c in saved] == [
        c.token_ids for c in step0
    ]
    assert (tmp_path / "run" / "rollouts" / "step_1.jsonl").exists()


@pytest.mark.parametrize(
    "lines,message",
    [
        (
            GROUPS[:5],
            r"the group starting at .*rollouts\.jsonl:5 has 1 completions but rollout\.samples_per_prompt is 2",
        ),
        (GROUPS[:2], r"holds 1 groups, fewer than rollout\.prompts_per_step = 2"),
        (
            [*GROUPS[:5], _line([11], [4], prompt_index=9, logprob_temperature=0.5)],
            r"rollouts\.jsonl:6: logprob_temperature 0\.5 but the source's first line has 1\.0",
        ),
    ],
)
def test_unusable_sources_are_rejected_naming_the_line(tmp_path, lines, message):
    config = _config(tmp_path, _source(tmp_path, lines))
    with pytest.raises(ValueError, match=message):
        StepRollouts(config, CountTask(vocab_size=VOCAB), VOCAB)


def test_malformed_or_out_of_vocabulary_lines_stop_the_job_before_it_starts(tmp_path):
    config = _config(tmp_path, _source(tmp_path, [*GROUPS[:3], "{", GROUPS[3]]))
    with pytest.raises(RolloutFileError, match=r"rollouts\.jsonl:4: bad JSON"):
        StepRollouts(config, CountTask(vocab_size=VOCAB), VOCAB)
    with pytest.raises(
        RolloutFileError, match=r"rollouts\.jsonl:3: token_ids\[1\] = 999 is outside"
    ):
        StepRollouts(_config(tmp_path, _source(tmp_path, GROUPS)), CountTask(vocab_size=500), 500)


def test_a_source_of_multi_turn_records_keeps_their_policy_mask(tmp_path):
    """Episodes from another engine: their observations stay context in the step's batch."""
    from rl_engine.executors.job.step_batch import train_batch

    lines = [
        _line([5, 6], [7, 8, 9], reward=1.0, policy_mask=[1, 0, 1]),
        _line([5, 6], [7, 3], reward=0.0, policy_mask=[1, 1]),
        _line([10], [1, 2, 4, 4], reward=0.5, policy_mask=[1, 0, 0, 1]),
        _line([10], [2], reward=0.0),
    ]
    config = _config(tmp_path, _source(tmp_path, lines), save=True)
    completions, rewards, _ = StepRollouts(config, CountTask(vocab_size=VOCAB), VOCAB)(0, None)
    assert [getattr(c, "policy_mask", None) for c in completions] == [
        [True, False, True],
        [True, True],
        [True, False, False, True],
        None,
    ]
    batch = train_batch(config, completions, rewards, eos=2)
    assert batch.num_tokens == 2 + 2 + 2 + 1
    assert batch.response_mask[0, 1:4].tolist() == [True, False, True]
    saved = (tmp_path / "run" / "rollouts" / "step_0.jsonl").read_text().splitlines()
    assert [json.loads(line).get("policy_mask") for line in saved] == [
        [1, 0, 1],
        [1, 1],
        [1, 0, 0, 1],
        None,
    ]
    bad = _config(tmp_path, _source(tmp_path, [*lines[:3], _line([10], [2], policy_mask=[0])]))
    with pytest.raises(RolloutFileError, match=r"rollouts.jsonl:4: policy_mask marks no token"):
        StepRollouts(bad, CountTask(vocab_size=VOCAB), VOCAB)
