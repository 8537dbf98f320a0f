"""A Ray job whose engine is tensor parallel (2 processes) next to 2 ZeRO-3 trainer ranks.

The model is an HF folder (tiny-llama, tied head): each TP rank builds it from the config
and reads only its rows of the safetensors (`engine_from_folder`); the trainer ranks load
it whole. Strict parity at every step (the step-1 rollout runs on weights each TP rank received,
its shards only, from the ZeRO-3 partitions); the job's own local Ray cluster counts
every TP process (4 CPUs: a cluster sized without them cannot place the engine);
actors.json has one `rollout engine` record per TP rank with its `tp_rank`.
"""

from __future__ import annotations

import json
import os

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.job.ray_job import run_job
from rl_engine.models import build_tiny_model
from tests.executors.jobs import job_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_tp2_engine_with_two_zero3_ranks_has_parity_one_every_step(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the job starts and sizes its own cluster
    run, folder = tmp_path / "run", tmp_path / "tiny-llama"
    build_tiny_model("tiny-llama", seed=3).save_pretrained(folder)
    data = job_config(
        run,
        steps=2,
        rollout={"tensor_parallel_size": 2},
        trainer={"num_ranks": 2, "zero_stage": 3},
    ).to_dict()
    config = RunConfig.from_dict({**data, "model": str(folder)})
    history = run_job(config)
    assert [m["parity/exact_match_fraction"] for m in history] == [1.0, 1.0]
    assert [m["weight_version"] for m in history] == [1, 2]
    actors = json.loads((run / "actors.json").read_text())
    engines = [a for a in actors if a["role"] == "rollout engine"]
    assert [(a["rank"], a["tp_rank"]) for a in engines] == [(0, 0), (0, 1)]
    assert len({a["pid"] for a in engines}) == 2 and os.getpid() not in {a["pid"] for a in engines}
    assert all("tp_rank" not in a for a in actors if a["role"] == "trainer rank")
