"""Weight syncs over a real gloo group: 2 sender processes -> 2 engine processes (weight_sync_procs.py).

The chains checked:
- plan "everything" (tensor parallel size 1), into engines whose weights were released
  first (which then refuse to generate): each engine's parameters after the sync
  equal the senders' model (torch.equal), and its completions equal those of a
  reference engine holding the senders' model bit for bit (negative control: before
  the sync they differ);
- a 2-receiver plan with output-dim (rows) and input-dim (columns) slices: each
  receiver's shard equals full[slice] of the senders' tensor;
- a sender dying after its first bucket: both receivers raise naming the closed
  connection, keep the version they served, and refuse to generate on torn weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_engine.executors.worker.distributed import free_port
from tests.helpers.rollout import weight_sync_procs as procs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # 4 processes: 20-60 s

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("weight_sync")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    roles = [("sender", i) for i in range(procs.SENDERS)]
    roles += [("receiver", i) for i in range(procs.RECEIVERS)]
    logs = {r: open(out / f"{r[0]}{r[1]}.log", "w") for r in roles}  # noqa: SIM115 - closed below
    children = {
        r: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.rollout.weight_sync_procs",
                r[0],
                str(r[1]),
                str(port),
                str(out),
            ],
            env=env,
            cwd=REPO,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in roles
    }
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in children.values()):
            time.sleep(0.2)
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()
    errors = sorted(out.glob("*.error"))
    assert not errors, errors[0].read_text()
    found = [out / f"receiver{i}.pt" for i in range(procs.RECEIVERS)]
    missing = [p.name for p in found if not p.is_file()]
    assert not missing, f"no {missing}; logs: " + " | ".join(
        (out / f"{r[0]}{r[1]}.log").read_text()[-2000:] for r in roles
    )
    return [torch.load(p, weights_only=False) for p in found]


def test_everything_plan_makes_each_engine_the_senders_model(results):
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.rollout import RolloutEngine

    senders_model = procs.model("tiny-llama", seed=1)
    expected_state = senders_model.state_dict()
    apply_batch_invariant(senders_model)
    reference = RolloutEngine(senders_model, device="cpu", max_batch_size=2, progress=False)
    expected = reference.generate(procs.PROMPTS, procs.sampling())
    for got in results:
        assert got["released"] > got["packed_before_release"] > 0
        assert got["packed_after_release"] == 0  # the packed copies go with the weights
        assert "released until the next weight sync" in got["generate_released"]
        assert got["version"] == procs.VERSIONS[0]
        assert got["state"].keys() == expected_state.keys()
        for name, tensor in expected_state.items():
            assert torch.equal(got["state"][name], tensor), name
        assert [c.token_ids for c in got["after"]] == [c.token_ids for c in expected]
        for a, b in zip(got["after"], expected):
            assert torch.equal(a.logprobs, b.logprobs) and a.weight_version == procs.VERSIONS[0]
        before = got["before"]  # negative control: the seed-0 weights sample other logprobs
        assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(before, expected))


def test_split_plan_gives_each_receiver_its_shards(results):
    full = procs.model("tiny-qwen2", seed=1).state_dict()
    sliced = 0
    for got in results:
        assert got["split_version"] == procs.VERSIONS[1]
        for name, shard in got["shards"].items():
            piece = got["plan"].slices[name]
            want = (
                full[name]
                if piece is None
                else torch.cat(
                    [full[name].narrow(piece.dim, a, b - a) for a, b in piece.ranges], piece.dim
                )
            )
            sliced += piece is not None
            assert torch.equal(shard, want), name
    dims = {p.dim for got in results for p in got["plan"].slices.values() if p is not None}
    assert sliced > 10 and dims == {0, 1}


def test_a_sender_dying_mid_sync_leaves_every_receiver_refusing_to_generate(results):
    for got in results:
        assert re.search(r"from sender 1: .*Connection (closed|reset) by peer", got["fault"])
        assert got["fault_buckets"] >= 1  # it died mid-sync: some buckets had landed
        assert got["version_after_fault"] == procs.VERSIONS[0]  # the engine's last complete sync
        assert "weights are incomplete" in got["generate_after_fault"]
        assert f"version {procs.VERSIONS[2]}" in got["generate_after_fault"]
