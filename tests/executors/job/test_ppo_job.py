"""PPO with a critic as a Ray job: critic ranks as actors, warm-up, parity, resume.

One 2-step run (critic.warmup_steps 1, a checkpoint after each step), then the run
resumed from its step-1 checkpoint (a copy of the run directory without the later
checkpoint): the resumed step 1 must equal the uninterrupted one, metrics (critic/*
included) and the policy's final weights file, which needs the critic's state
(its values decide the advantages of step 1) restored bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.export import export_checkpoint
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.worker.weights.weights_file import read_weights_file
from tests.helpers.job.jobs import job_config, stopped_and_resumed, without_timings

CRITIC_KEYS = {
    "critic/value_loss",
    "critic/clip_fraction",
    "critic/explained_variance",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/warmup",
}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ppo_job_warms_up_keeps_parity_and_resumes_bitwise(tmp_path, job_ray):
    run = tmp_path / "run"
    config = job_config(
        run,
        steps=2,
        algorithm={"name": "ppo"},
        critic={"lr": 1e-3, "warmup_steps": 1},
        checkpoint={"every": 1, "keep_last": 2},
    )
    history = run_job(config)
    assert [m["updates"] for m in history] == [0, 1]  # step 0: only the critic trains
    assert [m["weight_version"] for m in history] == [0, 1]
    assert [m["critic/warmup"] for m in history] == [1, 0]
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] == m["tokens"]
        assert CRITIC_KEYS <= m.keys() and m["critic/skipped_update"] == 0
    assert history[0]["critic/values_mean"] == 0.0  # the value head starts at zero
    assert history[1]["critic/values_mean"] != 0.0  # the critic learnt in the warm-up step
    roles = [(a["role"], a["rank"]) for a in json.loads((run / "actors.json").read_text())]
    assert ("critic rank", 0) in roles and ("trainer rank", 0) in roles
    assert (run / "checkpoints" / "step000002" / "critic" / "latest").is_file()

    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step000002")
    (copy / "checkpoints" / "latest").write_text("step000001\n")
    resumed = run_job(dataclasses.replace(config, output_dir=str(copy)), resume=True)
    assert len(resumed) == 2
    assert without_timings(copy) == without_timings(run)
    weights = "checkpoints/step000002/weights.safetensors"
    assert (copy / weights).read_bytes() == (run / weights).read_bytes()

    # rl-engine export: the policy only (the exported model loads the policy's weights strictly)
    exported = export_checkpoint(run, tmp_path / "export")
    assert (exported / "config.json").is_file()
    assert not any("critic" in str(p) for p in exported.rglob("*"))
    assert not any("value" in name for name in read_weights_file(run / weights))


@pytest.mark.slow
@pytest.mark.exhaustive  # make test keeps the LoRA job under GRPO and the critic's adapter at worker level
@pytest.mark.multiprocess
def test_ppo_job_with_lora_policy_and_critic_is_exact_and_resumes_bitwise(tmp_path, job_ray):
    """lora.rank > 0 under PPO, 2 ZeRO-3 ranks each for the policy and the critic: parity 1.0
    at every step; the critic's checkpoint (its optimizer's fp32 partitions) holds its own
    adapter and value head alone, the adapter moved by training; and a run stopped after 2
    steps and resumed writes the metrics of the uninterrupted 3-step run."""
    sections = {
        "algorithm": {"name": "ppo"},
        "critic": {"lr": 1e-3, "warmup_steps": 1},
        "trainer": {"num_ranks": 2, "zero_stage": 3},
        "lora": {"rank": 4, "alpha": 8},
    }
    whole = tmp_path / "whole"
    run_job(job_config(whole, steps=3, **sections))
    part = stopped_and_resumed(tmp_path / "part", **sections)

    expected = without_timings(whole)
    assert without_timings(part) == expected
    assert [m["critic/warmup"] for m in expected] == [1, 0, 0]
    assert [m["weight_version"] for m in expected] == [0, 1, 2]
    for m in expected:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] == m["tokens"]
        assert CRITIC_KEYS <= m.keys() and m["critic/skipped_update"] == 0
    assert expected[0]["critic/values_mean"] == 0.0 != expected[2]["critic/values_mean"]

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    critic = get_fp32_state_dict_from_zero_checkpoint(ckpt.latest(whole).critic_dir, "state")
    adapters = {name for name in critic if ".lora_A." in name or ".lora_B." in name}
    assert adapters and set(critic) == adapters | {"head.weight", "head.bias"}
    assert all(critic[n].abs().sum() > 0 for n in adapters if ".lora_B." in n)  # B starts at 0
