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
from tests.helpers.job.jobs import job_config, without_timings

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _tp_job(tmp_path, name: str, tensor_parallel_size: int) -> list[dict]:
    """A 2-step job from an HF folder of tiny-llama: the engine at this TP degree, 2 ZeRO-3 ranks."""
    run, folder = tmp_path / name, tmp_path / "tiny-llama"
    if not folder.exists():
        build_tiny_model("tiny-llama", seed=3).save_pretrained(folder)
    data = job_config(
        run,
        steps=2,
        rollout={"tensor_parallel_size": tensor_parallel_size},
        trainer={"num_ranks": 2, "zero_stage": 3},
    ).to_dict()
    return run_job(RunConfig.from_dict({**data, "model": str(folder)}))


def test_tp2_engine_with_two_zero3_ranks_has_parity_one_every_step(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the job starts and sizes its own cluster
    run = tmp_path / "run"
    history = _tp_job(tmp_path, "run", 2)
    assert [m["parity/exact_match_fraction"] for m in history] == [1.0, 1.0]
    assert [m["weight_version"] for m in history] == [1, 2]
    actors = json.loads((run / "actors.json").read_text())
    engines = [a for a in actors if a["role"] == "rollout engine"]
    assert [(a["rank"], a["tp_rank"]) for a in engines] == [(0, 0), (0, 1)]
    assert len({a["pid"] for a in engines}) == 2 and os.getpid() not in {a["pid"] for a in engines}
    assert all("tp_rank" not in a for a in actors if a["role"] == "trainer rank")


@pytest.mark.exhaustive  # one more 2-rank job
def test_tp2_job_metrics_equal_the_tp1_jobs(tmp_path, monkeypatch):
    """The same job with a TP = 1 engine: metrics.jsonl has the same keys and, TP = 2 giving
    TP = 1's bits, the same values on every key but the wall-clock `time/` ones."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tp2, tp1 = _tp_job(tmp_path, "tp2", 2), _tp_job(tmp_path, "tp1", 1)
    assert [set(m) for m in tp2] == [set(m) for m in tp1]
    assert without_timings(tmp_path / "tp2") == without_timings(tmp_path / "tp1")


def _lora_job(tmp_path, name: str, tensor_parallel_size: int) -> list[dict]:
    """A 2-step LoRA job (rank 4, tiny-llama): the engine at this TP degree (each rank loads the
    whole policy, then holds its rows of W and B and all of A), 2 ZeRO-3 trainer ranks."""
    config = job_config(
        tmp_path / name,
        steps=2,
        rollout={"tensor_parallel_size": tensor_parallel_size},
        trainer={"num_ranks": 2, "zero_stage": 3},
        lora={"rank": 4, "alpha": 8},
    )
    return run_job(config)


@pytest.mark.exhaustive  # make test runs its LoRA job on a TP = 2 engine: test_lora_job
def test_tp2_engine_serves_a_lora_policy_with_parity_one_and_adapter_only_syncs(
    tmp_path, monkeypatch
):
    """The step-1 rollout runs on adapters each TP rank received (its B rows, the whole A) from
    the ZeRO-3 partitions; strict parity holds at every step."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    history = _lora_job(tmp_path, "lora_tp2", 2)
    assert [m["parity/exact_match_fraction"] for m in history] == [1.0, 1.0]
    assert [m["weight_version"] for m in history] == [1, 2]
    model = build_tiny_model("tiny-llama", seed=3)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = [m["weight_sync/bytes"] for m in history]
    assert sent[0] > model_bytes and 0 < sent[1] < 0.1 * model_bytes, sent


@pytest.mark.exhaustive  # one more 2-rank job
def test_tp2_lora_job_metrics_equal_the_tp1_jobs(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tp2, tp1 = _lora_job(tmp_path, "tp2", 2), _lora_job(tmp_path, "tp1", 1)
    assert [set(m) for m in tp2] == [set(m) for m in tp1]
    assert without_timings(tmp_path / "tp2") == without_timings(tmp_path / "tp1")
