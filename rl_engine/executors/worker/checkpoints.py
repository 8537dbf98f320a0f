"""Weights out of the worker (HF state dict, or a weights file) and DeepSpeed checkpoints in and out.

Under ZeRO-3 both weight paths gather one bucket of parameters at a time
(`trainer.weight_sync_bucket_mb`), never the whole model on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torch import nn

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.layout_free.state import (
    load_layout_free_checkpoint,
    save_layout_free_checkpoint,
)
from rl_engine.executors.worker.weights.lora_base import LORA_BASE_FILE, check_base
from rl_engine.executors.worker.weights.weight_transport import full_shape, policy_tensors
from rl_engine.executors.worker.weights.weights_file import WeightsFileWriter
from rl_engine.base.io import write_text_atomic


def gathered_buckets(policy: nn.Module, *, zero3: bool, deepspeed, bucket_bytes: int):
    """The policy's tensors, [(names, full tensor)] a bucket of at most `bucket_bytes` at a time
    (one tensor larger than that alone). Under ZeRO-3 each bucket is gathered on every rank for
    the body of the loop (collective: every rank iterates) and released after it, so no rank
    ever holds more than one bucket beyond its own partitions."""
    bucket, used = [], 0
    for names, tensor in policy_tensors(policy):
        size = _numel(full_shape(tensor)) * tensor.dtype.itemsize
        if bucket and used + size > bucket_bytes:
            yield from _gathered(bucket, zero3, deepspeed)
            bucket, used = [], 0
        bucket.append((names, tensor))
        used += size
    if bucket:
        yield from _gathered(bucket, zero3, deepspeed)


def _gathered(bucket, zero3: bool, deepspeed):
    if not zero3:
        yield bucket
        return
    params = [t for _, t in bucket if hasattr(t, "ds_id")]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield bucket


def export_state_dict(policy: nn.Module, *, zero3: bool, rank: int, deepspeed, bucket_bytes: int):
    """The full state dict under the HF names (CPU copies, tied names share one tensor) on rank 0,
    None on the others; collective under ZeRO-3, one gathered bucket at a time."""
    copies = {}
    for bucket in gathered_buckets(
        policy, zero3=zero3, deepspeed=deepspeed, bucket_bytes=bucket_bytes
    ):
        if rank == 0:
            copies.update({names: tensor.detach().to("cpu", copy=True) for names, tensor in bucket})
    if rank != 0:
        return None
    by_name = {name: copy for names, copy in copies.items() for name in names}
    return {name: by_name[name] for name in policy.state_dict(keep_vars=True)}  # its order


def save_weights_file(
    policy: nn.Module, path: Path, *, zero3: bool, rank: int, deepspeed, bucket_bytes: int
) -> Path | None:
    """The policy as a safetensors file written by rank 0 as the buckets arrive (collective
    under ZeRO-3); returns the path on rank 0, None elsewhere."""
    writer = None
    if rank == 0:
        entries = [
            (names, full_shape(tensor), tensor.dtype) for names, tensor in policy_tensors(policy)
        ]
        writer = WeightsFileWriter(path, entries)
    try:
        for bucket in gathered_buckets(
            policy, zero3=zero3, deepspeed=deepspeed, bucket_bytes=bucket_bytes
        ):
            if writer is not None:
                for _, tensor in bucket:
                    writer.write(tensor)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return None if writer is None else writer.close()


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def save_checkpoint(
    engine, comm: Collectives, directory: Path, tag: str, state: dict, base: dict | None = None
) -> None:
    """Every rank writes into a temporary tag folder; then rank 0 renames it and points `latest` at it.

    `base` (a LoRA run: the base model's spec and content hash): the frozen base is left out
    (the adapters and their optimizer state are what a resume needs) and recorded instead."""
    staging = f".{tag}.tmp"
    engine.save_checkpoint(
        str(directory),
        tag=staging,
        client_state=state,
        save_latest=False,
        exclude_frozen_parameters=base is not None,
    )
    comm.barrier()
    if comm.rank == 0:
        if base is not None:
            write_text_atomic(directory / staging / LORA_BASE_FILE, json.dumps(base))
        final = directory / tag
        if final.exists():
            shutil.rmtree(final)
        os.replace(directory / staging, final)
        write_text_atomic(directory / "latest", tag)
    comm.barrier()


def load_checkpoint(
    engine, directory: Path, tag: str | None, base: dict | None = None
) -> tuple[str, dict]:
    """(path loaded, client state) of `save_checkpoint`'s checkpoint; ValueError when there is
    none, or (`base`: a LoRA run's) when its adapters were trained on another base, checked
    before anything is loaded."""
    if not Path(directory).is_dir():
        raise ValueError(f"checkpoint directory {str(directory)!r} does not exist")
    check_base(Path(directory), tag, base)
    path, state = engine.load_checkpoint(str(directory), tag=tag, load_module_strict=base is None)
    if path is None:
        raise ValueError(f"no DeepSpeed checkpoint found in {str(directory)!r} (tag {tag!r})")
    return path, state or {}


def save_worker_checkpoint(
    engine, comm: Collectives, directory: Path, tag: str, state: dict, base, *, layout_free: bool
) -> None:
    """A worker's checkpoint: the layout-free state under trainer.layout_invariant (any layout
    resumes it), else DeepSpeed's (`save_checkpoint`)."""
    if layout_free:
        save_layout_free_checkpoint(engine, comm, directory, tag, state, base)
    else:
        save_checkpoint(engine, comm, directory, tag, state, base)


def load_worker_checkpoint(
    engine, directory: Path, tag: str | None, base, *, layout_free: bool
) -> tuple[str, dict]:
    """(path loaded, client state) of `save_worker_checkpoint`'s checkpoint."""
    if layout_free:
        return load_layout_free_checkpoint(engine, directory, tag, base)
    return load_checkpoint(engine, directory, tag, base)
