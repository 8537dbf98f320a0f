"""Episodes in rollout files: `policy_mask` written and read back with the single-turn fields;
a malformed mask is a bad line with its number, like any other."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.envs import Episode
from rl_engine.envs.files import parse_episode_rollouts, write_episodes
from rl_engine.rollout import Completion, read_rollouts


def _episode(prompt_index: int, mask: list[bool]) -> Episode:
    tokens = [10 + i for i in range(len(mask))]
    logprobs = torch.tensor([-0.5 - i if m else 0.0 for i, m in enumerate(mask)])
    return Episode(
        prompt_ids=[3, 4, 5],
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason="done",
        weight_version=2,
        prompt_index=prompt_index,
        sample_index=0,
        logprob_temperature=0.7,
        reward=1.5,
        policy_mask=mask,
        turns=2,
    )


def test_episodes_round_trip_with_their_mask_beside_plain_completions(tmp_path):
    plain = Completion([3, 4], [7, 8], torch.tensor([-1.25, -2.5]), "stop", 1, 1, 0, 0.7)
    episodes = [_episode(0, [True, True, False, False, True]), plain]
    path = write_episodes(tmp_path / "e.jsonl", episodes)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["policy_mask"] == [1, 1, 0, 0, 1] and "policy_mask" not in lines[1]
    parsed = parse_episode_rollouts(path)
    assert not parsed.bad_lines and parsed.sources == [(str(path), 1), (str(path), 2)]
    back, again = parsed.completions
    assert isinstance(back, Episode) and type(again) is Completion
    assert back.policy_mask == [True, True, False, False, True]
    assert torch.equal(back.logprobs, episodes[0].logprobs) and back.reward == 1.5
    assert back.token_ids == episodes[0].token_ids and back.logprob_temperature == 0.7
    # the single-turn reader reads the same file (and ignores the mask, as any other key)
    assert [c.token_ids for c in read_rollouts(path)] == [e.token_ids for e in episodes]


@pytest.mark.parametrize(
    ("mask", "problem"),
    [
        ([1, 0], "length mismatch: 3 token_ids but 2 policy_mask entries"),
        ([0, 0, 0], "marks no token as the policy's"),
        ([1, 2, 0], "must be a list of 0 / 1"),
        ([1.0, 0, 1], "must be a list of 0 / 1"),
        ("111", "must be a list of 0 / 1"),
    ],
)
def test_a_malformed_mask_is_a_bad_line(tmp_path, mask, problem):
    good = json.dumps(
        {"prompt_token_ids": [3], "token_ids": [4, 5, 6], "logprobs": [-1.0, 0.0, -2.0]}
    )
    bad = json.loads(good) | {"policy_mask": mask}
    path = tmp_path / "r.jsonl"
    path.write_text(good + "\n" + json.dumps(bad) + "\n")
    parsed = parse_episode_rollouts(path)
    assert len(parsed.completions) == 1 and [b.line for b in parsed.bad_lines] == [2]
    assert problem in parsed.bad_lines[0].problem
    assert str(parsed.bad_lines[0]).startswith(f"{path}:2: ")
