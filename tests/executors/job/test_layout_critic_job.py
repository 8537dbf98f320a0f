"""trainer.layout_invariant under PPO as a whole Ray job: two runs whose policy AND critic
layouts differ (ranks, ZeRO stage, micro-batching, packing) write the same run: the same
metrics outside time/* (critic/* included) and the same final training state of the policy
and of the critic; a run stopped on one pair of layouts resumes on the other exactly. The
worker-level tests (tests/executors/worker/test_layout_invariance_critic.py) hold the critic's
negative control.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import RunDirError, resume_config
from rl_engine.executors.worker.layout_free.state import STATE_FILE
from tests.helpers.job.jobs import job_config, without_timings

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


@pytest.mark.multiprocess
@pytest.mark.slow  # 4 PPO jobs, 30-60 s each
@pytest.mark.exhaustive  # make test: the worker-level pair of critic layouts
def test_ppo_runs_on_other_policy_and_critic_layouts_write_the_same_run(tmp_path, job_ray):
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

    elastic = tmp_path / "elastic"
    run_job(_config(elastic, POLICY_TWO_CRITIC_ONE, steps=2))
    layout = ["trainer.num_ranks=1", "trainer.zero_stage=0", "trainer.micro_batch_size=8"]
    layout += ["trainer.packing=true", "critic.num_ranks=2", "critic.zero_stage=3"]
    run_job(resume_config(elastic, None, ["steps=3", *layout]), resume=True)
    assert without_timings(elastic) == metrics
    last = ckpt.latest(elastic)
    assert _differing(_state(last.deepspeed_dir), _state(last_one.deepspeed_dir)) == []
    assert _differing(_state(last.critic_dir), _state(last_one.critic_dir)) == []


def test_the_critic_layout_changes_on_resume_only_under_layout_invariant(tmp_path):
    for flag in (True, False):
        run_dir = tmp_path / str(flag)
        run_dir.mkdir()
        config = _config(run_dir, POLICY_TWO_CRITIC_ONE)
        data = config.to_dict()
        data["trainer"]["layout_invariant"] = flag
        RunConfig.from_dict(data).to_yaml(run_dir / "config.yaml")
        overrides = ["critic.num_ranks=2", "critic.zero_stage=3"]
        if flag:
            resumed = resume_config(run_dir, None, overrides)
            assert (resumed.critic.num_ranks, resumed.critic.zero_stage) == (2, 3)
            continue
        with pytest.raises(RunDirError, match=r"critic.num_ranks 1 -> 2.*layout_invariant: true"):
            resume_config(run_dir, None, overrides)
