"""trainer.layout_invariant under PPO as a whole Ray job: two runs whose policy AND critic
layouts differ (ranks, ZeRO stage, micro-batching, packing) write the same run: the same
metrics outside time/* (critic/* included) and the same final training state of the policy
and of the critic. The worker-level tests (tests/executors/worker/test_layout_invariance_critic.py)
hold the critic's negative control and its resume on another layout.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.worker.layout_free_state import STATE_FILE
from tests.executors.job.jobs import job_config, without_timings

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.exhaustive]

# (trainer keys, critic keys): each run has 1 + 2 DeepSpeed ranks and one engine
POLICY_ONE_CRITIC_TWO = (
    {"num_ranks": 1, "zero_stage": 0, "micro_batch_size": 8, "packing": True},
    {"num_ranks": 2, "zero_stage": 3},
)
POLICY_TWO_CRITIC_ONE = (
    {"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 2, "packing": False},
    {"num_ranks": 1, "zero_stage": 0},
)


def _config(run_dir, layout, steps: int = 3) -> RunConfig:
    trainer, critic = layout
    config = job_config(
        run_dir,
        steps=steps,
        algorithm={"name": "ppo"},
        trainer={**trainer, "layout_invariant": True},
        critic={"lr": 1e-3, **critic},
    )
    return RunConfig.from_dict({**config.to_dict(), "dtype": "bfloat16"})


def _state(folder) -> dict:
    return torch.load(next(folder.rglob(STATE_FILE)), weights_only=True)["training"]


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def test_ppo_runs_on_other_policy_and_critic_layouts_write_the_same_run(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_job(_config(one, POLICY_ONE_CRITIC_TWO))
    run_job(_config(two, POLICY_TWO_CRITIC_ONE))
    metrics = without_timings(one)
    assert metrics == without_timings(two)
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in metrics)
    assert metrics[-1]["critic/values_mean"] != 0.0  # the critic learnt: its values moved
    last_one, last_two = ckpt.latest(one), ckpt.latest(two)
    assert last_one.step == last_two.step == 3
    assert _differing(_state(last_one.deepspeed_dir), _state(last_two.deepspeed_dir)) == []
    assert _differing(_state(last_one.critic_dir), _state(last_two.critic_dir)) == []
