"""The critic on two DeepSpeed ranks under ZeRO-3, run on every rank by `ds_runner.py`.

Each rank: the values of its shard (parameters partitioned, gathered per module), one
update on its rows (the returns of GAE at V = 0, i.e. the rewards), then the values of
the whole batch (a collective: both ranks score all of it), the gathered weights, a
checkpoint and a fresh worker restored from it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.worker.cell import to_batch
from tests.helpers.worker.critic_setup import critic_config, gae_returns


def run(spec: dict, out_dir: Path, rank: int) -> dict:
    import deepspeed

    from rl_engine.executors.worker.critic.worker import CriticWorker

    completions = torch.load(spec["completions"]["float32"], weights_only=False)
    batch = to_batch(completions)
    config = critic_config(critic={"num_ranks": 2, "zero_stage": 3})
    worker = CriticWorker(config, device="cpu")
    shard_values = worker.values(batch.shard(rank, 2))
    values = worker.values(batch)
    returns = gae_returns(batch, values)
    rows = batch.shard_rows(rank, 2)
    metrics = worker.train_step(batch.shard(rank, 2), returns[rows], values[rows])
    after = worker.values(batch)
    with deepspeed.zero.GatheredParameters(list(worker.module.parameters())):
        state = {k: v.detach().clone() for k, v in worker.module.state_dict().items()}
    worker.save_checkpoint(out_dir / "critic")
    resumed = CriticWorker(config, device="cpu")
    resumed.load_checkpoint(out_dir / "critic")
    return {
        "shard_values": shard_values,
        "metrics": metrics,
        "after": after,
        "state": state,
        "resumed": resumed.values(batch),
        "zero_stage": worker.zero_stage,
    }
