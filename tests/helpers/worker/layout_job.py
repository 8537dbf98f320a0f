"""One rank of the layout-invariance tests (tests/executors/worker/test_layout_invariance.py).

spec: stage, dtype, trainer (the layout keys: micro_batch_size, packing,
max_tokens_per_micro_batch, layout_invariant, mini_batch_size, epochs), steps, and optionally
lora (the `lora:` section), save / resume (a layout-free state file written after `save_after`
steps, 0: before any, or restored before the first) and save_checkpoint / load_checkpoint (the
same through the worker's checkpoint folder, which checks a LoRA run's base). Every rank takes its shard of
the same cached completions (2 prompts x 4 samples), trains `steps` steps on it (parity
'report': from step 2 on the batch is off-policy), and returns the metrics of each step and
the layout-free state (fp32 masters and AdamW moments, gathered per parameter) after the last.
"""

from __future__ import annotations

import torch

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.executors.worker.layout_free.state import gather_state, restore_state
from tests.helpers.worker.cell import cell_config, to_batch


def _worker(spec: dict) -> DeepSpeedTrainingWorker:
    config = cell_config(
        spec["stage"],
        spec["world"],
        spec["dtype"],
        model=spec.get("model"),
        parity="report",
        trainer={"lr": 1e-3, "grad_clip": spec.get("grad_clip", 1.0), **spec["trainer"]},
        algorithm={"kl_coef": spec.get("kl_coef", 0.0), **spec.get("algorithm", {})},
        lora=spec.get("lora", {}),
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def run(spec: dict, out_dir, rank: int) -> dict:
    world = spec["world"]
    worker = _worker(spec)
    batch = to_batch(torch.load(spec["completions"], weights_only=False))
    mini = worker.config.mini_batches_per_step
    shard = batch.shard(rank, world, mini_batches=mini)
    if spec.get("resume"):
        restore_state(worker.engine, torch.load(spec["resume"], weights_only=False))
    if spec.get("load_checkpoint"):
        worker.load_checkpoint(spec["load_checkpoint"])
    if spec.get("save") and spec.get("save_after") == 0:  # before any step: no moments yet
        state = gather_state(worker.engine)
        if rank == 0:
            torch.save(state, spec["save"])
    metrics = []
    for step in range(spec["steps"]):
        metrics.append(worker.train_step(shard))
        if step + 1 == spec.get("save_after", -1):
            _save(worker, spec, rank)
    return {"metrics": metrics, "state": gather_state(worker.engine)}


def _save(worker: DeepSpeedTrainingWorker, spec: dict, rank: int) -> None:
    if spec.get("save"):
        state = gather_state(worker.engine)
        if rank == 0:
            torch.save(state, spec["save"])
    if spec.get("save_checkpoint"):
        worker.save_checkpoint(spec["save_checkpoint"])
