"""DAPO's sampling rules in the job's rollout step: rollout.filter_groups and algorithm.overlong_penalty.

A real RolloutEngine (tiny-llama) generates; the count task scores (1 token, so a group of 2
has equal rewards about 3 times in 4 and the filter has work to do).
"""

from __future__ import annotations

import pytest

from rl_engine.config import RunConfig
from rl_engine.data.tasks import CountTask
from rl_engine.executors.job.prompts import prompt_key
from rl_engine.executors.job.rollouts import StepRollouts, step_sampling
from tests.helpers.worker.cell import rollout_engine


def _config(max_new_tokens=1, **rollout_and_algorithm):
    algorithm = rollout_and_algorithm.pop("algorithm", {})
    return RunConfig.from_dict(
        {
            "seed": 3,
            "rollout": {
                "prompts_per_step": 4,
                "samples_per_prompt": 2,
                "max_new_tokens": max_new_tokens,
                **rollout_and_algorithm,
            },
            "algorithm": algorithm,
        }
    )


@pytest.fixture(scope="module")
def engine():
    return rollout_engine(_config())


def _run(config, engine, step):
    task = CountTask(vocab_size=engine.vocab_size, seed=config.seed)

    def generate(prompts, attempt=0):
        return engine.generate(prompts, step_sampling(config, step, None, attempt), progress=False)

    return StepRollouts(config, task, engine.vocab_size)(step, generate)


def _groups(completions, rewards):
    groups = {}
    for c, r in zip(completions, rewards):
        groups.setdefault(c.prompt_index, []).append(r)
    return groups


def test_filter_keeps_only_groups_with_signal_and_repeats_itself(engine):
    config = _config(filter_groups=True, filter_groups_max_tries=30)
    completions, rewards, metrics = _run(config, engine, step=2)
    groups = _groups(completions, rewards)
    assert sorted(groups) == [0, 1, 2, 3] and all(len(g) == 2 for g in groups.values())
    assert all(max(g) > min(g) for g in groups.values())  # every kept group has signal
    assert metrics["rollout/filter_tries"] > 1 and metrics["rollout/filter_filled"] == 0
    assert metrics["rollout/filter_dropped"] > 0
    again = _run(config, engine, step=2)  # (seed, step) decide every round: a resume repeats it
    assert [c.token_ids for c in again[0]] == [c.token_ids for c in completions]
    assert [c.prompt_ids for c in again[0]] == [c.prompt_ids for c in completions]
    assert again[1] == rewards


def test_round_zero_is_the_unfiltered_step_and_the_cap_fills_with_dropped_groups(engine):
    plain, plain_rewards, _ = _run(_config(), engine, step=5)
    capped = _config(filter_groups=True, filter_groups_max_tries=1)
    completions, rewards, metrics = _run(capped, engine, step=5)
    equal = sum(max(g) == min(g) for g in _groups(plain, plain_rewards).values())
    assert equal > 0, "the negative control: round 0 has groups without signal"
    assert metrics["rollout/filter_tries"] == 1 and metrics["rollout/filter_filled"] == equal
    # the same groups, those with signal first
    key = lambda c: (c.prompt_ids, c.token_ids)  # noqa: E731
    assert sorted(map(key, completions)) == sorted(map(key, plain))
    assert sorted(rewards) == sorted(plain_rewards)
    first = _groups(completions, rewards)
    assert all(max(first[i]) > min(first[i]) for i in range(4 - equal))


def test_later_rounds_draw_other_prompts():
    assert prompt_key(7, 0) == 7
    keys = {prompt_key(s, a) for s in range(50) for a in range(1, 5)}
    assert len(keys) == 200 and all(k < 0 for k in keys)
    config = _config()
    seeds = {step_sampling(config, s, None, a).seed for s in range(50) for a in range(5)}
    assert len(seeds) == 250


def test_overlong_penalty_shapes_the_rewards(engine):
    # max 6 tokens, buffer 4, factor 0.5: lengths 1, 2 get 0, then -0.125 per token to -0.5
    config = _config(max_new_tokens=6, algorithm={"overlong_penalty": {"buffer": 4, "factor": 0.5}})
    plain_config = _config(max_new_tokens=6)
    completions, rewards, metrics = _run(config, engine, step=1)
    plain, plain_rewards, _ = _run(plain_config, engine, step=1)
    assert [c.token_ids for c in plain] == [c.token_ids for c in completions]
    expected = [-0.5 * max(0, len(c.token_ids) - 2) / 4 for c in completions]
    assert any(e < 0 for e in expected)
    assert [r - p for r, p in zip(rewards, plain_rewards)] == pytest.approx(expected, abs=1e-7)
    assert metrics["reward/overlong_penalty"] == pytest.approx(sum(expected) / len(expected))


def test_dapo_config_errors_name_their_keys(tmp_path):
    with pytest.raises(ValueError, match="rollout.filter_groups_max_tries must be an int >= 1"):
        _config(filter_groups=True, filter_groups_max_tries=0)
    with pytest.raises(ValueError, match=r"algorithm.overlong_penalty.buffer = 9 is more than"):
        _config(max_new_tokens=6, algorithm={"overlong_penalty": {"buffer": 9, "factor": 1.0}})
    with pytest.raises(ValueError, match="rollout.filter_groups samples more prompts"):
        _config(filter_groups=True, source=str(tmp_path))
