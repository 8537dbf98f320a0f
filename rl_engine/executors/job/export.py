"""`rl-engine export RUN_DIR --to DIR [--step N]`: a checkpoint as a Hugging Face model folder.

The folder holds config.json, model.safetensors and, when the model has one, the
tokenizer: `AutoModelForCausalLM.from_pretrained(DIR)` loads it (and so does
`load_model(DIR)`). The weights are the checkpoint's weights file (written by trainer rank
0), the exact tensors the rollout engines served from that step on, so the exported model,
patched, reproduces the trainer's logprobs at that step bit for bit.

A LoRA run (lora.rank > 0) exports a PEFT adapter folder instead, or with `merged` a full
Hugging Face folder with the adapters folded in (export_lora.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from rl_engine.base.io import FILE_MODE
from rl_engine.config import RunConfig
from rl_engine.executors.job import job_checkpoints as ckpt

log = logging.getLogger("rl_engine.export")


def export_checkpoint(
    run_dir: str | Path, to: str | Path, step: int | None = None, merged: bool = False
) -> Path:
    """Write the checkpoint after `step` steps (latest by default) to `to`; returns `to`.
    A LoRA run's: its PEFT adapter folder, or with `merged` the model with the adapters
    folded in."""
    from rl_engine.models import load_model, quiet_loading
    from rl_engine.models.build import plain_model_like

    run_dir, to = Path(run_dir), Path(to)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ValueError(f"--to {str(to)!r} already exists and is not empty")
    found = ckpt.at_step(run_dir, step)
    config = RunConfig.from_yaml(found.config_path)
    log.info("exporting %s (model %s, %s) to %s", found.path, config.model, config.dtype, to)
    if merged and not config.lora.enabled:
        raise ValueError("--merged folds LoRA adapters in: this run has lora.rank 0 (no adapters)")
    quiet_loading()
    staging = to.with_name(f".{to.name}.tmp")
    if staging.exists():
        shutil.rmtree(staging)
    if config.lora.enabled:
        from rl_engine.executors.job.export_lora import write_lora_export

        tokenizer = write_lora_export(config, found.load_weights(), staging, merged)
    else:
        loaded, tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
        model = plain_model_like(loaded.config, config.torch_dtype)
        model.load_state_dict(found.load_weights(), strict=True)
        model.save_pretrained(staging, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    for path in staging.rglob("*"):
        if path.is_file():
            os.chmod(path, FILE_MODE)
    if to.exists():
        to.rmdir()  # empty (checked above)
    os.replace(staging, to)
    return to
