"""One critic rank of the critic's layout-invariance tests (test_layout_invariance_critic.py).

spec: critic (num_ranks, zero_stage), trainer (micro_batch_size, packing, layout_invariant,
...), dtype, model, steps, completions, and optionally save / resume (a critic checkpoint
directory written after `save_after` steps, or restored before the first). Each step does
what the PPO job does: every rank scores its contiguous shard (V_old; the shards' values
gathered into the batch's), GAE's returns from them, then the update on the rank's rows of
each mini-batch. Returns each step's metrics and gathered values, and the layout-free state
(fp32 masters and AdamW moments, gathered per parameter) after the last step.
"""

from __future__ import annotations

import torch

from rl_engine.executors.worker.critic.worker import CriticWorker
from rl_engine.executors.worker.layout_free.state import gather_state
from tests.helpers.worker.cell import to_batch
from tests.helpers.worker.critic_setup import critic_config, gae_returns


def _worker(spec: dict) -> CriticWorker:
    config = critic_config(
        {"grad_clip": spec.get("grad_clip", 1.0), **spec["trainer"]},
        {"value_clip": 0.2, **spec["critic"]},
        dtype=spec["dtype"],
        model=spec["model"],
        parity="off",
    )
    return CriticWorker(config, device="cpu")


def run(spec: dict, out_dir, rank: int) -> dict:
    world = spec["world"]
    worker = _worker(spec)
    batch = to_batch(torch.load(spec["completions"], weights_only=False))
    mini = worker.config.mini_batches_per_step
    if spec.get("resume"):
        worker.load_checkpoint(spec["resume"])
    metrics, values_seen = [], []
    for step in range(spec["steps"]):
        values = torch.cat(worker.comm.all_gather(worker.values(batch.shard(rank, world))))
        returns = gae_returns(batch, values)
        rows = batch.shard_rows(rank, world, mini)
        shard = batch.shard(rank, world, mini)
        metrics.append(worker.train_step(shard, returns[rows], values[rows]))
        values_seen.append(values)
        if spec.get("save") and step + 1 == spec.get("save_after", -1):
            worker.save_checkpoint(spec["save"])
    return {
        "metrics": metrics,
        "values": values_seen,
        "state": gather_state(worker.engine),
        "updates": worker.updates,
    }
