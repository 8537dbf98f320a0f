"""One rank of the 2-rank mini-batch test (tests/executors/worker/test_mini_batches.py), run by ds_runner.py.

ZeRO-3, fp32, 2 mini-batches x 2 epochs. On each rank: a strict step whose mismatch (one
rollout logprob nudged by one ulp, in the second mini-batch, on the last rank only) must be
caught by the scoring pass on every rank before any update; then the real step on the same
worker; then the reference, four plain one-update steps on the mini-batches in order, on a
fresh worker from the same initial weights.
"""

from __future__ import annotations

import dataclasses

import torch

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker, ParityError
from tests.helpers.worker.cell import cell_config, to_batch

MINI = 4  # sequences per mini-batch over both ranks: 2 mini-batches of the cell's 8


def _worker(world: int, prompts: int, **trainer) -> DeepSpeedTrainingWorker:
    config = cell_config(
        3,
        world,
        "float32",
        parity="strict" if trainer else "report",
        rollout={"prompts_per_step": prompts},
        trainer={"lr": 1e-3, **trainer},
        algorithm={"kl_coef": 0.0},
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def run(spec: dict, out_dir, rank: int) -> dict:
    world = spec["world"]
    batch = to_batch(torch.load(spec["completions"]["float32"], weights_only=False))
    shard = batch.shard(rank, world, mini_batches=batch.num_sequences // MINI)
    worker = _worker(world, 2, mini_batch_size=MINI, epochs=2)
    out = {"strict_error": None}
    bad = shard
    if rank == world - 1:  # its last row is in the second mini-batch
        seq, pos = (int(v) for v in shard.response_mask.nonzero()[-1])
        bad = dataclasses.replace(shard, rollout_logprobs=shard.rollout_logprobs.clone())
        value = bad.rollout_logprobs[seq, pos]
        bad.rollout_logprobs[seq, pos] = torch.nextafter(value, torch.tensor(0.0))
    try:
        worker.train_step(bad)
    except ParityError as err:
        out["strict_error"] = str(err)
    out["step_after_strict"] = worker.global_step
    out["metrics"] = worker.train_step(shard)  # the pass raised before any backward: usable
    out["tokens"] = int(batch.response_mask.sum())
    weights = worker.export_weights()
    plain = _worker(world, 1)
    for k in range(4):
        mini = batch._rows(slice((k % 2) * MINI, (k % 2 + 1) * MINI))
        plain.train_step(mini.shard(rank, world))
    reference = plain.export_weights()
    if rank == 0:
        out["weights_differ"] = sorted(
            n for n in weights if not torch.equal(weights[n], reference[n])
        )
    return out
