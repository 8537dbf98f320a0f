"""The bad-batch session, run on every rank of one 2-rank job (see test_bad_batches.py).

The LAST rank holds the bad data in every case; the other ranks hold a good shard.
One ZeRO-3 worker goes through every bad batch (each must end in a BatchError on
every rank, before any forward), an exception raised mid-forward on every rank,
a good step, and a step with a non-finite loss on the last rank (skipped on all
ranks); a ZeRO-0 worker repeats the non-finite step (there DeepSpeed does not skip
by itself: the worker's StepGuard must). Results are plain data for the parent.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from rl_engine.executors import BatchError
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from tests.helpers.worker.cell import cell_config, to_batch


def _oov_padding(shard, worker):
    """Every padding position holds an id outside the vocabulary (the real tokens are fine)."""
    pad = torch.full_like(shard.input_ids[:, :1], worker.vocab_size)
    return dataclasses.replace(
        shard,
        input_ids=torch.cat([shard.input_ids, pad], dim=1),
        attention_mask=torch.cat([shard.attention_mask, torch.zeros_like(pad)], dim=1),
        response_mask=torch.cat([shard.response_mask, torch.zeros_like(pad, dtype=torch.bool)], 1),
        rollout_logprobs=torch.cat(
            [shard.rollout_logprobs, torch.zeros_like(pad, dtype=torch.float32)], 1
        ),
    )


def _nan_advantage(shard, worker):
    advantages = shard.advantages.clone()
    advantages[1] = float("nan")
    return dataclasses.replace(shard, advantages=advantages)


def _narrow_mask(shard, worker):
    mutated = dataclasses.replace(shard)
    mutated.attention_mask = shard.attention_mask[:, :-1]  # mutated after construction
    return mutated


def _stale_version(shard, worker):
    return dataclasses.replace(shard, weight_version=worker.weight_version + 7)


def _other_temperature(shard, worker):
    return dataclasses.replace(shard, logprob_temperature=1.0)  # the rollout sampled at 0.9


CASES = {
    "oov_padding": (_oov_padding, "position .* \\(a padding position\\) holds token id"),
    "nan_advantage": (_nan_advantage, "advantages must be finite; advantages\\[1\\] = nan"),
    "narrow_mask": (_narrow_mask, "attention_mask must have shape"),
    "stale_version": (_stale_version, "stale batch: sampled by weight_version 7 .* version 0"),
    "other_temperature": (
        _other_temperature,
        "different logprob_temperature \\(rank 0: 0.9, rank 1: 1.0\\)",
    ),
}


def _infinite_loss(shard, worker):
    """A finite but absurd rollout logprob under a negative advantage: the PPO ratio overflows."""
    logprobs, advantages = shard.rollout_logprobs.clone(), shard.advantages.clone()
    logprobs[0, int(shard.response_mask[0].nonzero()[0])] = -1e30
    advantages[0] = -1.0
    return dataclasses.replace(shard, rollout_logprobs=logprobs, advantages=advantages)


def optimizer_snapshot(worker) -> dict:
    """Clones of the torch optimizer's (fp32 master) parameters and state, by position."""
    optimizer, out = worker.guard.optimizer, {}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            out[f"param{g}.{i}"] = param.detach().clone()
            for key, value in optimizer.state.get(param, {}).items():
                out[f"state{g}.{i}.{key}"] = value.clone() if torch.is_tensor(value) else value
    return out


def same(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
    )


def _attempt(worker, batch) -> dict:
    start = time.monotonic()
    try:
        worker.train_step(batch)
        outcome = {"error": None}
    except BatchError as err:
        outcome = {"error": "BatchError", "message": str(err), "ranks": err.ranks}
    except Exception as err:  # reported, and fails the test
        outcome = {"error": type(err).__name__, "message": str(err)}
    return {**outcome, "seconds": time.monotonic() - start}


def _raise_mid_forward(worker) -> dict:
    """Every rank raises inside the final norm's forward, after ZeRO-3 gathered its weight."""
    norm = worker.module.policy.base_model.norm

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure mid-forward")

    norm.forward = broken
    try:
        return _attempt(worker, worker._test_good)
    finally:
        del norm.forward


def _skip_step(worker, good, rank, world) -> dict:
    worker.config = dataclasses.replace(worker.config, parity="report")
    weights, state = worker.export_weights(), optimizer_snapshot(worker)
    version = worker.weight_version
    metrics = worker.train_step(_infinite_loss(good, worker) if rank == world - 1 else good)
    return {
        "metrics": metrics,
        "weights_unchanged": same(weights, worker.export_weights()),
        "optimizer_unchanged": same(state, optimizer_snapshot(worker)),
        "version_unchanged": worker.weight_version == version,
        "next": worker.train_step(good),
    }


def run(spec: dict, out_dir: Path, rank: int) -> dict:
    world = spec["world"]
    completions = torch.load(spec["completions"]["float32"], weights_only=False)
    good = to_batch(completions).shard(rank, world)
    worker = DeepSpeedTrainingWorker(cell_config(3, world, "float32"), device="cpu")
    worker._test_good = good
    initial, state = worker.export_weights(), optimizer_snapshot(worker)
    out = {"cases": {}}
    for name, (make_bad, _) in CASES.items():
        out["cases"][name] = _attempt(worker, make_bad(good, worker) if rank == world - 1 else good)
    out["unchanged_after_bad"] = same(initial, worker.export_weights()) and same(
        state, optimizer_snapshot(worker)
    )
    out["mid_forward"] = _raise_mid_forward(worker)
    out["unchanged_after_mid_forward"] = same(initial, worker.export_weights())
    out["good_step"] = worker.train_step(good)
    out["skip_zero3"] = _skip_step(worker, good, rank, world)
    zero0 = DeepSpeedTrainingWorker(cell_config(0, world, "float32"), device="cpu")
    zero0.train_step(good)  # optimizer state exists before the skipped step
    out["skip_zero0"] = _skip_step(zero0, good, rank, world)
    return out
