"""The RL job end to end with real Ray actors and real DeepSpeed ranks (CPU, gloo).

Parity 1.0 at every step with ZeRO-0 on 1 rank and ZeRO-3 on 2 ranks, and the run
directory's files, are checked by test_job_lifecycle.py's resume test (its uninterrupted run).
"""

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.job.ray_job import run_job


def _config(tmp_path, **trainer):
    return RunConfig.from_dict(
        {
            "model": "tiny-llama",
            "dtype": "float32",
            "seed": 3,
            "batch_invariant": True,
            "parity": "strict",
            "output_dir": str(tmp_path / "run"),
            "steps": 2,
            "rollout": {
                "num_engines": 1,
                "max_batch_size": 3,
                "prompts_per_step": 2,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
            },
            "trainer": {"micro_batch_size": 4, "lr": 1e-2, **trainer},
        }
    )


@pytest.mark.multiprocess
@pytest.mark.exhaustive  # report mode: the worker tests; a job each step: every other job test
@pytest.mark.parametrize("parity", ["report", "off"])
def test_ray_job_parity_modes(tmp_path, parity, job_ray):
    """report: parity metrics every step, no error; off (written as YAML's unquoted `off`): none."""
    data = _config(tmp_path, num_ranks=1).to_dict()
    data.update(steps=1, batch_invariant=False)
    path = tmp_path / "run.yaml"
    RunConfig.from_dict({**data, "parity": "report"}).to_yaml(path)
    path.write_text(path.read_text().replace("parity: report", f"parity: {parity}"))
    config = RunConfig.from_yaml(path)
    assert config.parity == parity
    (metrics,) = run_job(config)
    assert metrics["skipped_update"] == 0 and metrics["weight_version"] == 1
    assert ("parity/num_tokens" in metrics) == (parity == "report")
    if parity == "report":  # invariance off: the mismatch is measured, not raised
        assert (
            metrics["parity/num_tokens"] > 0
            and 0.0 <= metrics["parity/exact_match_fraction"] <= 1.0
        )
