"""rollout.speculative in a Ray job: a draft model speculates on the engine, and the job writes
the rollouts, metrics and final weights of the same job without it, bit for bit, with the
speculation figures added (rollout/spec_accept_rate, rollout/spec_tokens_per_forward)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from tests.helpers.job.jobs import job_config, without_timings

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 2
SPEC_KEYS = ("rollout/spec_accept_rate", "rollout/spec_tokens_per_forward")


def _run(run_dir, **rollout):
    sections = {
        "rollout": {"save": True, "max_new_tokens": 10, **rollout},
        "checkpoint": {"every": STEPS, "keep_last": 1},
    }
    run_job(job_config(run_dir, steps=STEPS, **sections))
    weights = load_file(ckpt.latest(run_dir).path / "weights.safetensors")
    return without_timings(run_dir), weights


def test_a_speculating_job_writes_the_plain_jobs_run(tmp_path, job_ray):
    plain, plain_weights = _run(tmp_path / "plain")
    # a tiny-llama of another initialisation: some drafts accepted, most not
    draft = {"method": "draft_model", "num_tokens": 3, "model": "tiny-llama"}
    spec, spec_weights = _run(tmp_path / "spec", speculative=draft)
    for step in range(STEPS):
        name = f"rollouts/step_{step}.jsonl"
        assert (tmp_path / "plain" / name).read_text() == (tmp_path / "spec" / name).read_text()
    assert [{k: v for k, v in m.items() if k not in SPEC_KEYS} for m in spec] == plain
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in spec)
    assert all(0.0 < m["rollout/spec_accept_rate"] < 1.0 for m in spec)
    assert all(m["rollout/spec_tokens_per_forward"] > 1.0 for m in spec)
    assert [k for k in plain_weights if not torch.equal(plain_weights[k], spec_weights[k])] == []
