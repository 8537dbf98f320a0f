"""trainer.layout_invariant as a whole Ray job: a checkpoint of 2 ZeRO-3 ranks (padded
micro-batches) resumes on 1 ZeRO-0 rank (one packed micro-batch) and writes the same run
(metrics and training state); `exhaustive`: two layouts from the start write the same run.

The shared local Ray cluster (`job_ray`) serves the module. The worker-level tests
(tests/executors/worker/test_layout_invariance.py) cover more layouts and the negative control.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import RunDirError, resume_config
from rl_engine.executors.worker.layout_free.state import STATE_FILE
from tests.helpers.job.jobs import job_config, resumed_copy, without_timings

pytestmark = [pytest.mark.multiprocess]

ONE_PACKED = {"num_ranks": 1, "zero_stage": 0, "micro_batch_size": 8, "packing": True}
TWO_PADDED = {"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 2, "packing": False}


def _config(run_dir, trainer: dict, steps: int = 2):
    """`steps` steps, a checkpoint after each (a run resumes from step 1's)."""
    layout_free = {**trainer, "layout_invariant": True}
    checkpoint = {"every": 1, "keep_last": steps}
    config = job_config(run_dir, steps=steps, trainer=layout_free, checkpoint=checkpoint)
    return RunConfig.from_dict({**config.to_dict(), "dtype": "bfloat16"})


def _state(run_dir) -> dict:
    path = next(ckpt.latest(run_dir).deepspeed_dir.rglob(STATE_FILE))
    return torch.load(path, weights_only=True)["training"]


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def test_a_run_resumed_on_another_layout_writes_the_same_run(tmp_path, job_ray):
    """Three steps on 2 ZeRO-3 ranks (padded micro-batches of 2); a copy cut back to its step-1
    checkpoint resumes on 1 ZeRO-0 rank (one packed micro-batch of 8) and writes the same two
    remaining steps: metrics and training state. Two job starts: the layout is the subject, not
    the first step (the worker-level tests take every step of many layouts)."""
    two = tmp_path / "two"
    run_job(_config(two, TWO_PADDED, steps=3))
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in without_timings(two))

    one_packed = [f"trainer.{key}={str(value).lower()}" for key, value in ONE_PACKED.items()]
    elastic = resumed_copy(two, tmp_path / "elastic", step=1, overrides=one_packed)
    assert without_timings(elastic) == without_timings(two)
    assert _same(_state(elastic), _state(two)) == []


@pytest.mark.exhaustive  # 3 jobs (2 steps, 2 steps, 1 resumed step), 20-40 s each
def test_two_layouts_write_the_same_run_and_a_run_resumes_on_another_layout(tmp_path, job_ray):
    one, two = tmp_path / "one", tmp_path / "two"
    run_job(_config(one, ONE_PACKED))
    run_job(_config(two, TWO_PADDED))
    assert without_timings(one) == without_timings(two)
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in without_timings(one))
    assert _same(_state(one), _state(two)) == []

    # two's step-1 checkpoint (2 ZeRO-3 ranks) resumed on 1 ZeRO-0 rank
    layout = ("trainer.num_ranks=1", "trainer.zero_stage=0", "trainer.micro_batch_size=8")
    elastic = resumed_copy(two, tmp_path / "elastic", step=1, overrides=layout)
    assert without_timings(elastic) == without_timings(two)
    assert _same(_state(elastic), _state(two)) == []


def test_a_plain_run_refuses_another_layout_on_resume_naming_both(tmp_path):
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    config = job_config(run_dir, trainer={"num_ranks": 2, "zero_stage": 3})
    config.to_yaml(run_dir / "config.yaml")
    with pytest.raises(RunDirError, match=r"trainer.num_ranks 2 -> 1.*layout_invariant: true"):
        resume_config(run_dir, None, ["trainer.num_ranks=1"])
