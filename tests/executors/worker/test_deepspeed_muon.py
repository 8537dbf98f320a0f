"""DeepSpeed's Muon probe answered by a stand-in: a ZeRO-3 engine builds and steps without
importing torch's inductor, where DeepSpeed's own probe imports it (the negative control,
the same engine in a process without the stand-in); DeepSpeed's Muon, once imported, is
kept; building the stand-in says why it cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from rl_engine.executors.worker.deepspeed_muon import (
    MUON_MODULE,
    MuonWithAuxAdam,
    skip_muon_probe,
)
from rl_engine.executors.worker.distributed import free_port
from tests.helpers.job.jobs import REPO

ZERO3_ENGINE = """
import json, os, sys
import torch, deepspeed
if sys.argv[1] == "stand-in":
    from rl_engine.executors.worker.deepspeed_muon import skip_muon_probe
    assert skip_muon_probe()
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(8, 4)
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
before = [p.ds_tensor.clone() for p in engine.module.parameters()]
engine.backward(engine(torch.ones(1, 8)).sum())
engine.step()
moved = any(not torch.equal(b, p.ds_tensor) for b, p in zip(before, engine.module.parameters()))
print(json.dumps({"inductor": "torch._inductor.compile_fx" in sys.modules, "moved": moved}))
"""


@pytest.mark.multiprocess
def test_a_zero3_engine_steps_without_importing_the_inductor_only_with_the_stand_in():
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", ZERO3_ENGINE, mode, port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode, port in (("stand-in", str(free_port())), ("deepspeed", str(free_port())))
    }
    results = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{mode}: {err[-2000:]}"
        results[mode] = json.loads(out.strip().splitlines()[-1])
    assert results["stand-in"] == {"inductor": False, "moved": True}
    assert results["deepspeed"] == {"inductor": True, "moved": True}  # DeepSpeed's own probe


def test_the_stand_in_goes_in_only_where_deepspeeds_muon_is_not_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, MUON_MODULE, raising=False)
    assert skip_muon_probe()
    assert sys.modules[MUON_MODULE].MuonWithAuxAdam is MuonWithAuxAdam
    assert skip_muon_probe()  # a second call keeps the same stand-in

    real = types.ModuleType(MUON_MODULE)
    real.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
    monkeypatch.setitem(sys.modules, MUON_MODULE, real)
    assert not skip_muon_probe()
    assert sys.modules[MUON_MODULE] is real


def test_building_the_stand_in_says_why():
    with pytest.raises(RuntimeError, match="MuonWithAuxAdam is not available in an rl_engine"):
        MuonWithAuxAdam(params=[])
