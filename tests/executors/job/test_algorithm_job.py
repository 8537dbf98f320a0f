"""One fast Ray job with the algorithm keys that change a step: mini-batches x epochs, and
its resume.

Two DeepSpeed ranks under ZeRO-3 (the scoring pass and every forward are collectives there),
packed micro-batches under a token budget inside each mini-batch, RLOO advantages, DAPO's
group filter and overlong penalty: every step takes mini-batches x epochs updates, and parity
holds on every sequence. A copy of the run cut back to its step-1 checkpoint and resumed
writes the same metrics as the whole run on every key but the `time/` ones: the checkpoint
carries the AdamW moments of four updates, the sampling state of a filtered step and the
weight version.
"""

import pytest

from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import read_metrics
from tests.helpers.job.jobs import check_complete_run, job_config, resumed_copy, without_timings


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs: 2 steps, 1 resumed step
def test_job_with_mini_batches_and_epochs_resumes_bitwise(tmp_path, job_ray):
    whole = tmp_path / "whole"
    config = job_config(
        whole,
        steps=2,
        trainer={
            "num_ranks": 2,
            "zero_stage": 3,
            "micro_batch_size": 2,
            "max_tokens_per_micro_batch": 16,
            "mini_batch_size": 4,
            "epochs": 2,
            "lr": 1e-3,
        },
        rollout={"filter_groups": True, "filter_groups_max_tries": 2},
        algorithm={"advantage": "rloo", "overlong_penalty": {"buffer": 2, "factor": 0.5}},
        checkpoint={"every": 1},
    )
    history = run_job(config)
    check_complete_run(whole, history, num_ranks=2)
    assert len(history) == 2
    for step, m in enumerate(history):
        assert m["updates"] == 4 and m["skipped_update"] == 0
        assert m["weight_version"] == 4 * (step + 1)
        assert m["parity/exact_match_fraction"] == 1.0
        assert m["parity/num_tokens"] == m["tokens"]  # parity_scope all: every sequence
        assert 1 <= m["rollout/filter_tries"] <= 2 and m["reward/overlong_penalty"] <= 0

    part = resumed_copy(whole, tmp_path / "part", step=1)
    assert without_timings(part) == without_timings(whole)
    timings = read_metrics(part)[-1]
    for phase in ("step", "rollout", "batch", "train", "weight_sync", "driver_overhead"):
        assert timings[f"time/{phase}"] >= 0
    assert ckpt.latest(part).step == 2 and ckpt.complete_tags(part) == ["step000001", "step000002"]
