"""Weights out of the worker (HF state dict) and DeepSpeed checkpoints in and out, atomically."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.io import write_text_atomic


def export_state_dict(policy: nn.Module, *, zero3: bool, rank: int, deepspeed=None):
    """The full state dict under the HF names; collective under ZeRO-3 (rank 0 gets it, others None)."""
    if zero3:
        with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
            return _cpu_state_dict(policy) if rank == 0 else None
    return _cpu_state_dict(policy)


def _cpu_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies; tied names share one tensor."""
    out, copies = {}, {}
    for name, tensor in policy.state_dict(keep_vars=True).items():
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[id(tensor)]
    return out


def save_checkpoint(engine, comm: Collectives, directory: Path, tag: str, state: dict) -> None:
    """Every rank writes into a temporary tag folder; then rank 0 renames it and points `latest` at it."""
    staging = f".{tag}.tmp"
    engine.save_checkpoint(str(directory), tag=staging, client_state=state, save_latest=False)
    comm.barrier()
    if comm.rank == 0:
        final = directory / tag
        if final.exists():
            shutil.rmtree(final)
        os.replace(directory / staging, final)
        write_text_atomic(directory / "latest", tag)
    comm.barrier()


def load_checkpoint(engine, directory: Path, tag: str | None) -> tuple[str, dict]:
    """(path loaded, client state) of `save_checkpoint`'s checkpoint; ValueError when there is none."""
    if not Path(directory).is_dir():
        raise ValueError(f"checkpoint directory {str(directory)!r} does not exist")
    path, state = engine.load_checkpoint(str(directory), tag=tag)
    if path is None:
        raise ValueError(f"no DeepSpeed checkpoint found in {str(directory)!r} (tag {tag!r})")
    return path, state or {}
