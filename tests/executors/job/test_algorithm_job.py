"""One fast Ray job with the algorithm keys that change a step: mini-batches x epochs.

Two DeepSpeed ranks under ZeRO-3 (the scoring pass and every forward are collectives there),
packed micro-batches under a token budget inside each mini-batch, RLOO advantages, DAPO's
group filter and overlong penalty: every step takes mini-batches x epochs updates, and parity
holds on every sequence.
"""

import pytest

from rl_engine.executors.job.ray_job import run_job
from tests.helpers.job.jobs import job_config


@pytest.mark.multiprocess
def test_job_with_mini_batches_and_epochs(tmp_path, job_ray):
    config = job_config(
        tmp_path / "run",
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
    )
    history = run_job(config)
    assert len(history) == 2
    for step, m in enumerate(history):
        assert m["updates"] == 4 and m["skipped_update"] == 0
        assert m["weight_version"] == 4 * (step + 1)
        assert m["parity/exact_match_fraction"] == 1.0
        assert m["parity/num_tokens"] == m["tokens"]  # parity_scope all: every sequence
        assert 1 <= m["rollout/filter_tries"] <= 2 and m["reward/overlong_penalty"] <= 0
