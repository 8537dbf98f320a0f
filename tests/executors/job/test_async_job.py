"""Asynchronous RL in a Ray job (rollout.max_staleness k): real Ray, real DeepSpeed, tiny-llama.

With k = 2 (k = 1 in the exhaustive tier), 4 steps, parity 'strict':
- every step's rollouts come from the version of step max(0, s - k), and every token of every
  step is exact against the weights that sampled it (a mismatch would have raised);
- two runs of the same config write the same metrics and final weights, bit for bit, and a
  copy cut back to its step-2 checkpoint and resumed writes them too (the checkpoint carries
  the rollouts generated for steps 2 .. 1 + k);
- the negative control: a pending stale batch scored with the weights of its own version
  equals its rollout logprobs, and scored with the checkpoint's current weights it differs, so
  the check could fail.
`free` order runs exact too (its versions depend on timing; never more than k behind).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_engine.envs.files import parse_episode_rollouts
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.async_schedule import PENDING
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.logprobs import token_logprobs
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from tests.helpers.job.jobs import job_config, resumed_copy, without_timings

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 4
TIMED = ("async/overlap",)  # a share of wall-clock time, like the time/ keys


def _metrics(run) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMED} for m in without_timings(run)]


def _final_weights(run) -> dict[str, torch.Tensor]:
    return load_file(ckpt.latest(run).path / "weights.safetensors")


def _sections(k: int, order: str = "deterministic") -> dict:
    return {
        "rollout": {"max_staleness": k, "async_order": order, "max_new_tokens": 8},
        "checkpoint": {"every": 1, "keep_last": STEPS},
    }


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.exhaustive), 2])
def test_an_async_run_is_exact_reproducible_and_resumes(tmp_path, job_ray, k):
    first, second = tmp_path / "first", tmp_path / "second"
    history = run_job(job_config(first, steps=STEPS, **_sections(k)))
    assert [m["async/staleness_max"] for m in history] == [min(s, k) for s in range(STEPS)]
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] > 0
        assert m["parity/unverified_tokens"] == 0.0
        assert m["async/dropped"] == 0.0 and 0.0 <= m["async/overlap"] <= 1.0
        assert m["async/behaviour_ratio_max"] >= m["async/behaviour_ratio_mean"] > 0
    assert history[-1]["async/behaviour_ratio_max"] != 1.0  # stale: the ratio moved off 1

    run_job(job_config(second, steps=STEPS, **_sections(k)))
    resumed = resumed_copy(first, tmp_path / "resumed", step=2)
    expected, weights = _metrics(first), _final_weights(first)
    for other in (second, resumed):
        assert _metrics(other) == expected
        theirs = _final_weights(other)
        assert [n for n in weights if not torch.equal(weights[n], theirs[n])] == []

    _check_the_check_can_fail(first, k)


def _check_the_check_can_fail(run, k: int) -> None:
    """Step 1 + k's rollouts, pending in the step-2 checkpoint, were sampled by version 1 (while
    step 1 trained): exact under version 1's weights, not under the checkpoint's version 2."""
    held = ckpt.at_step(run, 2)
    parsed = parse_episode_rollouts(held.path / PENDING / f"step_{1 + k}.jsonl")
    comps = parsed.completions
    version = comps[0].weight_version
    assert version == 1
    batch = TrainBatch.from_completions(
        comps, [c.reward for c in comps], samples_per_prompt=4, pad_token_id=0
    )
    mask = batch.response_mask

    def scored(weights) -> torch.Tensor:
        model, _ = load_model("tiny-llama", seed=3)
        model.load_state_dict(weights, strict=True)
        with torch.no_grad():
            logp = token_logprobs(apply_batch_invariant(model).model, batch.input_ids)
        return logp[mask]

    own = scored(ckpt.at_step(run, version).load_weights())
    assert torch.equal(own, batch.rollout_logprobs[mask])
    newer = scored(held.load_weights())
    assert not torch.equal(newer, batch.rollout_logprobs[mask])


def test_free_order_is_exact_and_never_more_than_k_behind(tmp_path, job_ray):
    history = run_job(job_config(tmp_path / "free", steps=3, **_sections(2, "free")))
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] > 0
        assert 0 <= m["async/staleness_max"] <= 2
