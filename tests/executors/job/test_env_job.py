"""Jobs with an environment (rollout.env): multi-turn episodes trained with strict parity, and
environments that fail without stopping the job.

The tiny models have no tokenizer, so the environment answers in token ids
(tests/helpers/envs/scripted.py:Faulty, loaded by path as a user's file would be). Its episodes cycle
through four kinds: one that answers every turn (2 ids) to rollout.max_turns, one whose step
raises, one whose step hangs past rollout.env_timeout_s, one whose observation is larger than
rollout.max_total_tokens. Every step holds two of each.
"""

from __future__ import annotations

import time

import pytest

from rl_engine.envs.files import parse_episode_rollouts
from rl_engine.executors.job.preflight import validate_before_start
from rl_engine.executors.job.ray_job import run_job
from tests.helpers.job.jobs import REPO, job_config

SCRIPTED = str(REPO / "tests" / "helpers" / "envs" / "scripted.py")


def env_config(run_dir, **sections):
    rollout = {
        "env": f"{SCRIPTED}:Faulty",
        "env_args": {"hang_s": 60},
        "max_turns": 3,
        "max_total_tokens": 40,
        "env_timeout_s": 0.5,
        "save": True,
        **sections.pop("rollout", {}),
    }
    return job_config(run_dir, rollout=rollout, **sections)


def test_preflight_names_an_environment_that_does_not_load(tmp_path):
    broken = env_config(tmp_path / "a", rollout={"env": f"{SCRIPTED}:Missing"})
    with pytest.raises(ValueError, match=r"rollout.env .*has no class 'Missing'"):
        validate_before_start(broken)
    text = env_config(tmp_path / "b", rollout={"stop_strings": ["</calc>"]})
    with pytest.raises(ValueError, match="rollout.stop_strings needs a model with a tokenizer"):
        validate_before_start(text)


@pytest.mark.multiprocess
@pytest.mark.deadline  # a hanging environment is interrupted at rollout.env_timeout_s
def test_multi_turn_job_on_two_zero3_ranks_with_failing_environments(tmp_path, job_ray):
    run = tmp_path / "run"
    config = env_config(
        run,
        trainer={
            "num_ranks": 2,
            "zero_stage": 3,
            "micro_batch_size": 2,
            "max_tokens_per_micro_batch": 80,  # packed micro-batches under a token budget
        },
    )
    started = time.monotonic()
    history = run_job(config)
    assert time.monotonic() - started < 600, "a hanging environment held the job up"
    assert [m["step"] for m in history] == [0, 1, 2]
    for step, m in enumerate(history):
        assert m["parity/exact_match_fraction"] == 1.0 and m["skipped_update"] == 0
        assert (m["env/errors"], m["env/timeouts"], m["env/truncated"]) == (2.0, 2.0, 2.0)
        # two episodes play 3 turns, six end after their first: (2 * 3 + 6 * 1) / 8
        assert m["env/turns_mean"] == 1.5
        # answered turns score 0.5: 3 turns, or 1 before the flood; failed calls score 0
        assert m["reward_mean"] == (2 * 1.5 + 2 * 0.5) / 8
        episodes = parse_episode_rollouts(run / "rollouts" / f"step_{step}.jsonl").completions
        assert len(episodes) == 8 and all(hasattr(e, "policy_mask") for e in episodes)
        assert m["tokens"] == m["parity/num_tokens"] == sum(sum(e.policy_mask) for e in episodes)
        multi = [e for e in episodes if not all(e.policy_mask)]
        assert len(multi) == 2 and all(e.policy_mask.count(False) == 4 for e in multi)
        assert all(
            float(e.logprobs[i]) == 0.0 for e in multi for i, p in enumerate(e.policy_mask) if not p
        )


@pytest.mark.multiprocess
def test_the_calculator_job_on_two_zero3_ranks_trains_and_validates_on_its_data(tmp_path, job_ray):
    """The calculator on its data files, with text: a tiny Llama with a word-level tokenizer
    and chat template (tests/helpers/chat_model.py), 3 steps on 2 ZeRO-3 ranks, strict parity. A random
    tiny model never writes `<calc>...</calc>`, so the environment is the shipped Calculator
    whose first turn always counts as a call of the question's expression (CalledCalculator):
    its result comes back as a tool message of the chat template, then the model answers.
    Validation plays the same episodes (eval/* in the last row)."""
    from rl_engine.config import RunConfig
    from tests.helpers.chat_model import save_chat_model

    data = REPO / "configs" / "data"
    config = RunConfig.from_dict(
        {
            "model": str(save_chat_model(tmp_path / "model")),
            "seed": 3,
            "output_dir": str(tmp_path / "run"),
            "steps": 3,
            "rollout": {
                "max_batch_size": 4,
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "max_new_tokens": 6,
                "env": f"{SCRIPTED}:CalledCalculator",
                "stop_strings": ["</calc>"],
                "max_turns": 3,
                "max_total_tokens": 96,
                "save": True,
            },
            "trainer": {"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 2, "lr": 1e-2},
            "data": {
                "train_files": str(data / "calculator_train.jsonl"),
                "val_files": str(data / "calculator_val.jsonl"),
                "max_prompt_length": 64,
            },
            "eval": {"before_train": False},
        }
    )
    history = run_job(config)
    assert [m["step"] for m in history] == [0, 1, 2]
    for step, m in enumerate(history):
        assert m["parity/exact_match_fraction"] == 1.0
        assert m["env/errors"] == m["env/timeouts"] == m["env/truncated"] == 0.0
        assert m["env/turns_mean"] == 2.0 and 0.0 <= m["reward_mean"] <= 1.0
        episodes = parse_episode_rollouts(tmp_path / "run" / "rollouts" / f"step_{step}.jsonl")
        for e in episodes.completions:  # turn, the tool's answer, turn
            assert e.policy_mask.count(False) > 0 and e.policy_mask[-1]
    final = history[-1]
    assert final["eval/num_prompts"] == 64.0 and 0.0 <= final["eval/reward_mean"] <= 1.0
    assert "reward/errors" not in final  # no reward function ran: the environment scored


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.exhaustive  # two more 2-rank jobs
def test_a_tp2_engines_whole_transcript_episodes_equal_a_tp1_engines_continued_ones(
    tmp_path, monkeypatch, job_ray
):
    """A TP = 2 engine plays episodes by whole transcripts, environments in the driver; a
    TP = 1 engine continues them in its KV slots, environments in its actor. Each turn is
    seeded by (seed, episode, turn) and both paths are exact: metrics.jsonl is the same on
    every key but the wall-clock `time/` ones."""
    from rl_engine.config import RunConfig
    from rl_engine.models import build_tiny_model
    from tests.helpers.job.jobs import without_timings

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the job sizes its own cluster
    folder = tmp_path / "tiny-llama"
    build_tiny_model("tiny-llama", seed=3).save_pretrained(folder)
    histories = []
    for tp in (2, 1):
        data = env_config(
            tmp_path / f"tp{tp}",
            steps=2,
            rollout={"env": f"{SCRIPTED}:Mixed", "env_args": {}, "tensor_parallel_size": tp},
            trainer={"num_ranks": 2, "zero_stage": 3},
        ).to_dict()
        histories.append(run_job(RunConfig.from_dict({**data, "model": str(folder)})))
    assert all(m["parity/exact_match_fraction"] == 1.0 for h in histories for m in h)
    assert without_timings(tmp_path / "tp2") == without_timings(tmp_path / "tp1")
