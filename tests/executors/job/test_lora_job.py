"""A LoRA policy as a whole job: real Ray actors, 2 DeepSpeed ranks at ZeRO-3, one engine of
two tensor-parallel ranks (each loads the whole policy, then holds its rows of W and B and all
of A; the syncs after the first send each TP rank its B rows and the whole A).

Parity is strict (1.0) at every step, the sync after the first moves only the adapters
(`weight_sync/bytes` under 10% of the model's), and a run resumed from its step-1 checkpoint
writes the same metrics as the uninterrupted one on every key but the `time/` ones (two steps
suffice for each property: one sync after the first, one resumed step). `rl-engine export`
then writes the adapter folder PEFT loads, and `--merged` a full HF folder.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from rl_engine.cli import main
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.models import load_model
from tests.helpers.job.jobs import (
    job_config,
    resumed_copy,
    without_timings,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LORA = {"rank": 4, "alpha": 8}


def _model_bytes(name: str) -> int:
    model, _ = load_model(name)  # parameters() yields a tied weight once
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_lora_job_exact_syncs_adapters_only_and_resumes_bitwise(tmp_path, job_ray):
    trainer, rollout = {"num_ranks": 2, "zero_stage": 3}, {"tensor_parallel_size": 2}
    whole = tmp_path / "whole"
    config = job_config(
        whole, steps=2, trainer=trainer, rollout=rollout, lora=LORA, checkpoint={"every": 1}
    )
    run_job(config)
    part = resumed_copy(whole, tmp_path / "part", step=1)

    expected = without_timings(whole)
    assert [m["step"] for m in expected] == [0, 1]
    assert without_timings(part) == expected
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in expected)
    assert [m["weight_version"] for m in expected] == [1, 2]
    model_bytes = _model_bytes("tiny-llama")
    sent = [m["weight_sync/bytes"] for m in expected]
    assert sent[0] > model_bytes  # the first sync: the base (and the adapters) once
    assert all(0 < b < 0.1 * model_bytes for b in sent[1:]), sent

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(part), "--to", str(adapter)]) == 0
    assert main(["export", str(part), "--to", str(merged), "--merged"]) == 0
    base, _ = load_model("tiny-llama", seed=3)
    peft = PeftModel.from_pretrained(base, adapter)
    weights = ckpt.latest(part).load_weights()
    for name, tensor in peft.state_dict().items():
        if ".lora_" in name:
            assert torch.equal(tensor, weights[name.removeprefix("base_model.model.")]), name
    assert (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()
