"""One rank of the 2-rank packing test (tests/parity/test_packing.py), run by ds_runner.py.

ZeRO-3, fp32, packed micro-batches under a token budget that gives the two
shards different micro-batch counts (the rank with fewer runs empty ones). On
each rank: the packed logprobs, the padded ones, a strict step whose mismatch
(one rollout logprob nudged by one ulp) is on the last rank only (the worker is
unusable after it), then one real strict step on a fresh worker, and the same
step padded on a third one (same initial weights).
"""

from __future__ import annotations

import dataclasses

import torch

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker, ParityError
from rl_engine.logprobs.packing import plan_micro_batches
from tests.helpers.worker.cell import cell_config, to_batch


def _budget(batch, world: int) -> int:
    """The smallest budget >= the longest sequence at which the shards plan different counts."""
    lengths = batch.attention_mask.sum(1).tolist()
    per = len(lengths) // world
    shards = [lengths[r * per : (r + 1) * per] for r in range(world)]
    for budget in range(max(lengths), sum(lengths) + 1):
        counts = {len(plan_micro_batches(s, max_sequences=4, max_tokens=budget)) for s in shards}
        if len(counts) > 1:
            return budget
    raise AssertionError("no budget splits the shards unevenly")


def run(spec: dict, out_dir, rank: int) -> dict:
    world = spec["world"]
    batch = to_batch(torch.load(spec["completions"]["float32"], weights_only=False))
    budget = _budget(batch, world)
    shard = batch.shard(rank, world)
    trainer = {"packing": True, "max_tokens_per_micro_batch": budget, "micro_batch_size": 4}
    config = cell_config(3, world, "float32", trainer=trainer)
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    lengths = shard.attention_mask.sum(1).tolist()
    out = {
        "micro_batches": len(plan_micro_batches(lengths, max_sequences=4, max_tokens=budget)),
        "mask": shard.response_mask,
        "rollout_lp": shard.rollout_logprobs,
        "lp": worker.compute_logprobs(shard),
    }
    worker.config = dataclasses.replace(
        worker.config, trainer=dataclasses.replace(worker.config.trainer, packing=False)
    )
    out["padded_lp"] = worker.compute_logprobs(shard)
    worker.config = dataclasses.replace(
        worker.config, trainer=dataclasses.replace(worker.config.trainer, packing=True)
    )
    out["strict_error"], out["step_after_strict"] = _strict_mismatch(worker, shard, rank, world)
    out["metrics"] = DeepSpeedTrainingWorker(config, device="cpu").train_step(shard)
    padded = DeepSpeedTrainingWorker(cell_config(3, world, "float32"), device="cpu")
    out["padded_metrics"] = padded.train_step(shard)
    return out


def _strict_mismatch(worker, shard, rank: int, world: int):
    """A strict step with one rollout logprob nudged by one ulp on the last rank only."""
    if rank == world - 1:
        seq, pos = (int(v) for v in shard.response_mask.nonzero()[-1])
        shard = dataclasses.replace(shard, rollout_logprobs=shard.rollout_logprobs.clone())
        value = shard.rollout_logprobs[seq, pos]
        shard.rollout_logprobs[seq, pos] = torch.nextafter(value, torch.tensor(0.0))
    try:
        worker.train_step(shard)
        return None, worker.global_step
    except ParityError as err:
        return str(err), worker.global_step
