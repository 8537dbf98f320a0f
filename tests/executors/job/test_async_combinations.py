"""Asynchronous RL (rollout.max_staleness 1) with the rest of the job: every step exact (parity
'strict', stale steps checked against the weights that sampled them), staleness 1 from step 1.

The default tier runs LoRA on 2 ZeRO-3 ranks with a TP-2 engine (the adapters-only sync, the
ZeRO-3 partitions in the snapshot, a sharded engine); the exhaustive tier runs PPO with a
critic (its warm-up step takes no update, so the next step is on-policy), multi-turn episodes
in padded batches, prompt-lookup speculation, layout-invariant training with mini-batches
and epochs (decoupled PPO's proximal from the scoring pass) under DAPO's group filter, and the
vLLM engine on SmolLM2.
"""

from __future__ import annotations

import importlib.util

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.job.ray_job import run_job
from tests.helpers.job.jobs import REPO, job_config
from tests.helpers.rollout.vllm.common import NEEDS_SMOLLM2

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SCRIPTED = str(REPO / "tests" / "helpers" / "envs" / "scripted.py")
TWO_ZERO3 = {"num_ranks": 2, "zero_stage": 3}

CASES = {
    "lora-zero3-tp2": {
        "trainer": TWO_ZERO3,
        "rollout": {"tensor_parallel_size": 2},
        "lora": {"rank": 4, "alpha": 8},
    },
    "ppo-critic": {"algorithm": {"name": "ppo"}, "critic": {"lr": 1e-3, "warmup_steps": 1}},
    "multi-turn-padded": {
        "rollout": {
            "env": f"{SCRIPTED}:Mixed",
            "env_args": {},
            "max_turns": 3,
            "max_total_tokens": 40,
        },
        "trainer": {"packing": False},
    },
    "speculative": {"rollout": {"speculative": {"method": "ngram", "num_tokens": 3}}},
    "layout-invariant-minibatches-filter": {
        "trainer": {**TWO_ZERO3, "layout_invariant": True, "mini_batch_size": 4, "epochs": 2},
        "rollout": {"filter_groups": True},
    },
}
EXHAUSTIVE = tuple(case for case in CASES if case != "lora-zero3-tp2")


def _check(history: list[dict], staleness=(0, 1, 1)) -> None:
    assert [m["async/staleness_max"] for m in history] == list(staleness)
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] > 0
        assert m["parity/unverified_tokens"] == 0.0


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.exhaustive] if c in EXHAUSTIVE else []) for c in CASES],
)
def test_async_steps_stay_exact(tmp_path, job_ray, case):
    sections = {k: dict(v) for k, v in CASES[case].items()}
    sections.setdefault("rollout", {})["max_staleness"] = 1
    # PPO's critic warm-up step takes no update: step 1's rollouts are still on-policy
    _check(
        run_job(job_config(tmp_path / case, steps=3, **sections)),
        (0, 0, 1) if case == "ppo-critic" else (0, 1, 1),
    )


@pytest.mark.exhaustive  # a SmolLM2 job on vLLM's CPU build (~60 s)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@NEEDS_SMOLLM2
def test_async_steps_on_the_vllm_engine_stay_exact(tmp_path, job_ray):
    data = job_config(tmp_path / "vllm", steps=3).to_dict()
    data.update(model="smollm2-135m-instruct")
    data["rollout"].update(engine="vllm", max_staleness=1, task="tests.helpers.job.rewards:low_ids")
    data["trainer"]["lr"] = 1e-5
    _check(run_job(RunConfig.from_dict(data)))
