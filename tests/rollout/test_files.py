"""Rollout files (JSONL): exact round trip, GRPO groups, and every kind of malformed line."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.rollout import Completion, RolloutFileError, read_rollouts, write_rollouts
from rl_engine.rollout.files import parse_rollouts, rollout_files

GOOD = {"prompt_token_ids": [5, 6], "token_ids": [7, 8, 9], "logprobs": [-0.5, -1.25, -2.0]}


def _write_lines(path, lines):
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def _completion(prompt, tokens, prompt_index, sample_index, **extra):
    g = torch.Generator().manual_seed(len(tokens) + 7 * sample_index)
    return Completion(
        prompt_ids=prompt,
        token_ids=tokens,
        logprobs=-torch.rand(len(tokens), generator=g, dtype=torch.float32) * 5,
        finish_reason="length",
        weight_version=3,
        prompt_index=prompt_index,
        sample_index=sample_index,
        **extra,
    )


def test_round_trip_is_exact_for_every_field(tmp_path):
    written = [
        _completion([1, 2, 3], [4, 5], 0, 0, logprob_temperature=0.7, reward=0.25),
        _completion([1, 2, 3], [6], 0, 1, logprob_temperature=0.7, reward=1.0),
        _completion([9], [10, 11, 12], 1, 0),
    ]
    path = write_rollouts(tmp_path / "r.jsonl", written)
    back = read_rollouts(path, vocab_size=13)
    assert len(back) == 3
    for a, b in zip(written, back):
        assert torch.equal(a.logprobs, b.logprobs), "fp32 -> JSON -> fp32 must be exact"
        assert (a.prompt_ids, a.token_ids, a.prompt_index, a.sample_index) == (
            b.prompt_ids,
            b.token_ids,
            b.prompt_index,
            b.sample_index,
        )
        assert (a.logprob_temperature, a.reward, a.weight_version, a.finish_reason) == (
            b.logprob_temperature,
            b.reward,
            b.weight_version,
            b.finish_reason,
        )
    assert not list(tmp_path.glob(".*.tmp")), "write_rollouts must be atomic"


def test_groups_by_prompt_index_else_by_prompt_and_defaults(tmp_path):
    lines = [
        {**GOOD, "prompt_index": 7},
        {**GOOD, "prompt_token_ids": [1], "prompt_index": 4},
        GOOD,  # no prompt_index: grouped by its prompt ids, a group of its own
        {**GOOD, "prompt_index": 7},
        GOOD,
        "",  # blank lines are ignored
    ]
    got = read_rollouts(_write_lines(tmp_path / "r.jsonl", lines))
    assert [(c.prompt_index, c.sample_index) for c in got] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (2, 1),
    ]
    assert got[0].logprob_temperature == 1.0 and got[0].reward is None
    assert got[0].weight_version is None and got[0].finish_reason == "unknown"


BAD_LINES = [
    ("{not json", r"bad JSON"),
    ("[1, 2]", r"a line must be a JSON object, got list"),
    ({"token_ids": [1], "logprobs": [-1.0]}, r"missing field\(s\) prompt_token_ids"),
    ({**GOOD, "logprobs": [-1.0, -2.0]}, r"length mismatch: 3 token_ids but 2 logprobs"),
    (
        {**GOOD, "token_ids": [7, 8, 50]},
        r"token_ids\[2\] = 50 is outside the vocabulary \(vocabulary: 0\.\.49\)",
    ),
    (
        {**GOOD, "prompt_token_ids": [-1, 6]},
        r"prompt_token_ids\[0\] = -1 is outside the vocabulary",
    ),
    ({**GOOD, "logprobs": [-0.5, float("nan"), -2.0]}, r"logprobs\[1\] = nan is not finite"),
    ({**GOOD, "logprobs": [-0.5, float("-inf"), -2.0]}, r"logprobs\[1\] = -inf is not finite"),
    ({**GOOD, "token_ids": []}, r"token_ids must be a non-empty list"),
    ({**GOOD, "logprob_temperature": 0}, r"logprob_temperature must be a finite number > 0"),
    ({**GOOD, "reward": "high"}, r"reward must be a finite number or absent"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES)
def test_each_kind_of_malformed_line_is_rejected_with_its_line_number(tmp_path, bad, message):
    path = _write_lines(tmp_path / "r.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(RolloutFileError, match=rf"r\.jsonl:3: {message}") as err:
        read_rollouts(path, vocab_size=50)
    assert [b.line for b in err.value.bad_lines] == [3]
    assert len(read_rollouts(path, vocab_size=50, skip_bad_lines=True)) == 3


def test_a_group_is_one_prompt_and_all_bad_lines_are_listed(tmp_path):
    lines = [
        {**GOOD, "prompt_index": 0},
        {**GOOD, "prompt_index": 0, "prompt_token_ids": [1]},
        "{",
        GOOD,
    ]
    parsed = parse_rollouts(_write_lines(tmp_path / "r.jsonl", lines))
    assert [(b.line, b.problem.split(":")[0]) for b in parsed.bad_lines] == [
        (2, "prompt_index 0 has different prompt_token_ids than at r.jsonl"),
        (3, "bad JSON"),
    ]
    assert parsed.sources == [(str(tmp_path / "r.jsonl"), 1), (str(tmp_path / "r.jsonl"), 4)]


def test_a_folder_reads_its_step_files_in_step_order(tmp_path):
    for step in (10, 2):
        write_rollouts(tmp_path / f"step_{step}.jsonl", [_completion([step], [1], 0, 0)])
    (tmp_path / "notes.txt").write_text("ignored")
    assert [p.name for p in rollout_files(tmp_path)] == ["step_2.jsonl", "step_10.jsonl"]
    assert [c.prompt_ids for c in read_rollouts(tmp_path)] == [[2], [10]]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rollouts(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no step_N.jsonl files"):
        read_rollouts(empty)


def test_non_finite_logprobs_are_not_written(tmp_path):
    c = _completion([1], [2], 0, 0)
    c.logprobs[0] = float("inf")
    with pytest.raises(ValueError, match="logprobs must be finite"):
        write_rollouts(tmp_path / "r.jsonl", [c])
    assert not (tmp_path / "r.jsonl").exists()
