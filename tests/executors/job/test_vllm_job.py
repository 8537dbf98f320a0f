"""`rollout.engine: vllm` as a whole Ray job on SmolLM2-135M: the engine actor runs vLLM's CPU
build with rl_engine's plugin and sampler, and the DeepSpeed rank's weights go straight into
vLLM's worker every step (collective_rpc). Three steps with strict parity (1.0 every step,
prompts sharing the chat template's prefix in vLLM's prefix cache across weight updates), and
the same job on the own engine samples the same completions and ends with the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rl_engine.config import RunConfig
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import resume_config
from rl_engine.models import load_model
from rl_engine.rollout.vllm.folders import write_folder
from tests.helpers.job.jobs import job_config, without_timings
from tests.helpers.rollout.vllm.common import NEEDS_SMOLLM2, require_vllm

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 3


def smollm2_job(run_dir, engine: str) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": "smollm2-135m-instruct",
            "dtype": "float32",
            "seed": 3,
            "parity": "strict",
            "output_dir": str(run_dir),
            "steps": STEPS,
            "rollout": {
                "engine": engine,
                "max_batch_size": 4,
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "max_new_tokens": 8,
                "save": True,
                "task": "tests.helpers.job.rewards:low_ids",
            },
            "trainer": {"micro_batch_size": 4, "lr": 1e-5},
            # the final weights are all a test reads: no 1.6 GB of optimizer state to write
            "checkpoint": {"every": STEPS, "keep_last": 1, "weights_only": True},
        }
    )


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(ckpt.latest(run_dir).path / "weights.safetensors")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, module_job_ray):
    run_dir = tmp_path_factory.mktemp("vllm") / "run"
    return run_dir, run_job(smollm2_job(run_dir, "vllm"))


@NEEDS_SMOLLM2
def test_a_vllm_job_has_parity_one_every_step(vllm_run):
    run_dir, history = vllm_run
    assert [m["parity/exact_match_fraction"] for m in history] == [1.0] * STEPS
    assert all(m["parity/num_tokens"] > 0 for m in history)
    assert [m["weight_version"] for m in history] == list(range(1, STEPS + 1))
    engines = [
        a for a in json.loads((run_dir / "actors.json").read_text()) if "engine" in a["role"]
    ]
    assert len(engines) == 1


@NEEDS_SMOLLM2
@pytest.mark.exhaustive  # a second SmolLM2 job (~70 s); make test runs the engines side by side: test_exact_sampler
def test_the_own_engine_samples_the_same_and_ends_with_the_same_weights(vllm_run, tmp_path):
    """The same config on the own engine: the same rollouts (tokens, logprobs), the same
    metrics (wall-clock ones aside) and bitwise the same weights after the last step."""
    vllm_dir, _ = vllm_run
    own_dir = tmp_path / "own"
    run_job(smollm2_job(own_dir, "own"))
    for step in range(STEPS):
        name = f"rollouts/step_{step}.jsonl"
        assert (own_dir / name).read_text() == (vllm_dir / name).read_text(), name
    assert without_timings(own_dir) == without_timings(vllm_dir)
    own, vllm = final_weights(own_dir), final_weights(vllm_dir)
    assert own.keys() == vllm.keys()
    assert [k for k in own if not torch.equal(own[k], vllm[k])] == []
    start, _ = load_model("smollm2-135m-instruct", dtype=torch.float32)
    moved = [k for k, v in start.state_dict().items() if k in own and not torch.equal(v, own[k])]
    assert moved, "the weights never moved: equal final weights would prove nothing"


@pytest.mark.exhaustive  # three more job starts
def test_a_resumed_vllm_job_writes_the_uninterrupted_run(tmp_path, job_ray):
    """A tiny Llama (head size 32, vLLM's CPU cache takes it) on the vLLM engine: stopped
    after step 2 and resumed to step 3, the run equals the uninterrupted one (the resume's
    first sync lands the checkpoint's weights in vLLM and resets its prefix cache)."""
    folder = write_folder("tiny-llama", torch.float32, tmp_path)
    sections = {
        "rollout": {"engine": "vllm"},
        "checkpoint": {"every": 1, "keep_last": 3},
    }

    def config(run_dir, steps):
        data = job_config(run_dir, steps=steps, **sections).to_dict()
        return RunConfig.from_dict({**data, "model": str(folder)})

    whole = tmp_path / "whole"
    run_job(config(whole, 3))
    resumed = tmp_path / "resumed"
    run_job(config(resumed, 2))
    run_job(resume_config(resumed, None, ["steps=3"]), resume=True)
    assert without_timings(resumed) == without_timings(whole)
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in without_timings(whole))
