"""One rank of the 2-rank gradient-release test (tests/executors/worker/step/test_gradient_pages.py),
run by ds_runner.py.

ZeRO-3, bf16, three steps on the same shard, twice from the same initial weights: once with
ZeRO-3's flat gradient buffer released after every step (as the trainer actors do), once
with it kept. Returns both runs' metrics and weights, and what the released buffer held just
before and after each release.
"""

from __future__ import annotations

import torch

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.executors.worker.step.gradient_pages import release_gradient_partitions
from tests.helpers.worker.cell import cell_config, to_batch

STEPS = 3


def _run(shard, world: int, release: bool) -> dict:
    config = cell_config(
        3, world, "bfloat16", parity="report", trainer={"lr": 1e-3, "micro_batch_size": 2}
    )
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    buffer = worker.optimizer.grad_partitions_flat_buffer
    out = {"metrics": [], "nonzero_before": [], "nonzero_after": [], "released": []}
    for _ in range(STEPS):
        out["metrics"].append(worker.train_step(shard))
        if release:
            out["nonzero_before"].append(int(buffer.count_nonzero()))
            out["released"].append(release_gradient_partitions(worker.optimizer, dense=True))
            out["nonzero_after"].append(int(buffer.count_nonzero()))
    out["weights"] = worker.export_weights()
    out["buffer_bytes"] = buffer.numel() * buffer.element_size()
    out["moe_kept"] = release_gradient_partitions(worker.optimizer, dense=False)
    return out


def run(spec: dict, out_dir, rank: int) -> dict:
    world = spec["world"]
    batch = to_batch(torch.load(spec["completions"]["bfloat16"], weights_only=False))
    shard = batch.shard(rank, world)
    released = _run(shard, world, release=True)
    kept = _run(shard, world, release=False)
    return {"released": released, "kept": kept}
