"""LoRA cells of the worker on real DeepSpeed, run in-process (1 rank) or as a ds_runner.py job.

A cell's policy is the config's model with a PEFT adapter whose A and B are perturbed by a
seeded generator (B != 0, so the adapter matters); the RolloutEngine serves the same policy,
patched and unmerged, and samples the step. On each rank `run_lora_cell` records the worker's
logprobs of that step next to the engine's, takes one strict step, and records what the
step changed (base weights, adapters) and the optimizer state it holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rl_engine.config import LoraConfig, RunConfig
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.executors.worker.policy.setup import load_policy
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.lora import is_adapter_name
from rl_engine.rollout import RolloutEngine
from tests.helpers.lora_policy import perturb_adapters
from tests.helpers.worker.cell import cell_config, generate, to_batch

RANK, ALPHA = 4, 8


def lora_cell_config(
    stage: int, world: int, dtype: str, model: str, packing: bool, **overrides
) -> RunConfig:
    config = cell_config(stage, world, dtype, model, **overrides)
    trainer = dataclasses.replace(config.trainer, packing=packing)
    return dataclasses.replace(config, trainer=trainer, lora=LoraConfig(rank=RANK, alpha=ALPHA))


def lora_policy(config: RunConfig) -> torch.nn.Module:
    """The config's policy with its PEFT adapter perturbed (unpatched, on the CPU)."""
    model, _ = load_policy(config)
    perturb_adapters(model)
    return model


def lora_engine(model: torch.nn.Module) -> RolloutEngine:
    apply_batch_invariant(model)
    return RolloutEngine(model, device="cpu", max_batch_size=8, progress=False)


def lora_completions(config: RunConfig, seed: int = 5):
    return generate(lora_engine(lora_policy(config)), config, seed=seed)


def cell_key(stage: int, dtype: str, model: str, packing: bool) -> str:
    return f"{model}-{dtype}-zero{stage}-{'packed' if packing else 'padded'}"


def run_lora_cell(config: RunConfig, completions, model=None, workdir=None) -> dict:
    """One rank's cell (every rank builds the same perturbed policy unless `model` is given);
    with `workdir`, also a checkpoint and a resume."""
    worker = DeepSpeedTrainingWorker(config, device="cpu", model=model or lora_policy(config))
    shard = to_batch(completions).shard(worker.rank, worker.world_size)
    out = {"mask": shard.response_mask, "rollout_lp": shard.rollout_logprobs}
    out["lp0"] = worker.compute_logprobs(shard)
    before = worker.export_weights()
    out["metrics"] = worker.train_step(shard)  # strict: raises on any mismatch
    after = worker.export_weights()
    if before is not None:
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        out["changed"] = changed
        out["adapters"] = [k for k in before if is_adapter_name(k)]
        out["model_numel"] = sum(t.numel() for t in before.values())
        out["adapter_numel"] = sum(before[k].numel() for k in out["adapters"])
    out["optimizer_numel"] = sum(  # this rank's exp_avg: its share of the trained parameters
        int(state["exp_avg"].numel()) for state in worker.guard.optimizer.state.values()
    )
    out["trainable"] = sorted(
        n for n, p in worker.module.policy.named_parameters() if p.requires_grad
    )
    if workdir is not None:
        out.update(_resume(worker, config, shard, Path(workdir)))
    return out


def _resume(worker, config: RunConfig, shard, workdir: Path) -> dict:
    """Checkpoint (adapters and their optimizer state, the base's record), one more step; a
    fresh worker resumed from the checkpoint retakes that step: its weights must be equal."""
    worker.save_checkpoint(workdir / "ckpt")
    worker.config = dataclasses.replace(worker.config, parity="report")  # off-policy now
    worker.train_step(shard)
    weights = worker.export_weights()
    resumed = DeepSpeedTrainingWorker(
        dataclasses.replace(config, parity="report"), device="cpu", model=lora_policy(config)
    )
    resumed.load_checkpoint(workdir / "ckpt")
    resumed.train_step(shard)
    again = resumed.export_weights()
    if weights is None:
        return {}
    return {"resume_diff": sorted(k for k in weights if not torch.equal(weights[k], again[k]))}


def run(spec: dict, out_dir: Path, rank: int) -> dict:
    """ds_runner.py's entry: every [stage, dtype, model, packing] of spec["cells"]."""
    results = {}
    for cell in spec["cells"]:
        config = lora_cell_config(cell[0], spec["world"], *cell[1:])
        key = cell_key(*cell)
        completions = torch.load(spec["completions"][key], weights_only=False)
        results[key] = run_lora_cell(config, completions, workdir=out_dir / key)
    return results
