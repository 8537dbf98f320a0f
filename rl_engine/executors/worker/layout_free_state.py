"""The training state in a form no layout enters: per parameter name, the whole fp32 master
weight and AdamW's two moments, plus the step count.

DeepSpeed keeps these cut into partitions whose shape depends on the rank count and ZeRO stage;
its fragment accessors gather a parameter's whole tensor from them (a collective under ZeRO-3:
every rank calls in the same order) and write one back into whatever partition a rank holds.
So a state gathered on N ranks at one stage restores on M ranks at another, and since the
optimizer is elementwise (`InvariantAdamW`) the run continues as it would have.

ZeRO-0 has no fragments: in fp32 the module's parameters are the masters (no DeepSpeed wrapper),
in bf16 DeepSpeed's unfused optimizer keeps an fp32 master beside each parameter
(`fp32_groups` beside `fp16_groups`); the torch optimizer's state is keyed by the master.

Only trainable parameters are held: for a LoRA policy the adapters alone. Their checkpoint
records the frozen base as the plain LoRA checkpoint does (`lora_base.LORA_BASE_FILE`: the
model spec and its content hash), checked before anything is restored.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from rl_engine.executors.worker.weights.lora_base import LORA_BASE_FILE, check_base
from rl_engine.base.io import write_text_atomic

MOMENTS = ("exp_avg", "exp_avg_sq")


def gather_state(engine) -> dict[str, torch.Tensor]:
    """{name: fp32 master, name/exp_avg: ..., name/exp_avg_sq: ...} and "step" (collective)."""
    state: dict[str, torch.Tensor] = {}
    step = _step_count(engine)
    for name, param in _trainable(engine):
        state[name] = master = _full_master(engine, param).detach().clone()
        for key in MOMENTS:
            # before the first step the optimizer has made no moments: AdamW's are zeros then
            moment = _full_moment(engine, param, key) if step else torch.zeros_like(master)
            state[f"{name}/{key}"] = moment.detach().clone()
    state["step"] = torch.tensor(step, dtype=torch.int64)
    return state


def restore_state(engine, state: dict[str, torch.Tensor]) -> None:
    """Write `state` (from `gather_state` on any layout) into this engine's partitions."""
    names = {name for name, _ in _trainable(engine)}
    missing = sorted(names - state.keys())
    if missing:
        raise KeyError(f"layout-free state lacks parameters {missing[:5]} ({len(missing)} in all)")
    _set_step_count(engine, int(state["step"]))  # creates the moments DeepSpeed writes into
    for name, param in _trainable(engine):
        _set_master(engine, param, state[name])
        for key in MOMENTS:
            _set_moment(engine, param, state[f"{name}/{key}"], key)


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _fragmented(param) -> bool:
    """ZeRO 1-3 and the bf16 optimizer: DeepSpeed's fragment accessors serve the parameter."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")  # None: not on this rank


def _master(engine, param) -> torch.Tensor:
    """ZeRO-0: the fp32 master of `param` (itself in fp32, its `fp32_groups` twin in bf16)."""
    groups = getattr(engine.optimizer, "fp16_groups", None)
    if groups is None:
        return param
    for low, high in zip(groups, engine.optimizer.fp32_groups, strict=True):
        for index, candidate in enumerate(low):
            if candidate is param:
                return high[index]
    raise KeyError(f"parameter {tuple(param.shape)} has no fp32 master in the optimizer")


def _full_master(engine, param):
    return safe_get_full_fp32_param(param) if _fragmented(param) else _master(engine, param).data


def _full_moment(engine, param, key):
    if _fragmented(param):
        return safe_get_full_optimizer_state(param, key)
    return _base_optimizer(engine).state[_master(engine, param)][key]


def _set_master(engine, param, value):
    """The fp32 master, then the weight the forward reads (rounded once from it)."""
    if hasattr(param, "ds_tensor"):
        _set_zero3_partition(param, value, None)
    elif _fragmented(param):
        safe_set_full_fp32_param(param, value)
    else:
        _master(engine, param).data.copy_(value)
    if hasattr(param, "ds_id"):  # ZeRO-3: gathered, written, partitioned again (collective)
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value.to(param.dtype))
    elif _master(engine, param) is not param or _fragmented(param):
        param.data.copy_(value.to(param.dtype))


def _set_moment(engine, param, value, key):
    if hasattr(param, "ds_tensor"):
        _set_zero3_partition(param, value, key)
    elif _fragmented(param):
        safe_set_full_optimizer_state(param, value, key)
    else:
        _ensure_state(_base_optimizer(engine), _master(engine, param))[key].copy_(value)


def _set_zero3_partition(param, value: torch.Tensor, key: str | None) -> None:
    """This rank's slice of `value` into ZeRO-3's fp32 partition of `param` (key None) or of its
    moment `key`. DeepSpeed's own setter slices the unpadded whole, which fails on the rank
    whose partition is padding (a 1-element value-head bias on 2 ranks): the slice is padded
    with zeros here, as ZeRO-3 pads the partition itself."""
    z3 = param._z3_optimizer
    partition, _ = z3._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key
    )
    size = partition.numel()
    start = size * z3._get_param_partition_rank(param)
    piece = value.detach().reshape(-1)[start : start + size].to(partition.dtype)
    partition.data.copy_(torch.nn.functional.pad(piece, (0, size - piece.numel())))


def _base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrapper (or the engine's own, unwrapped)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _step_count(engine) -> int:
    steps = {int(s["step"]) for s in _base_optimizer(engine).state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer state holds different step counts {sorted(steps)}")
    return steps.pop() if steps else 0


def _set_step_count(engine, step: int) -> None:
    optimizer = _base_optimizer(engine)
    for param in _optimizer_params(engine, optimizer):
        _ensure_state(optimizer, param)["step"] = torch.tensor(float(step))
    # ZeRO-1/2 and the bf16 optimizer link each parameter's fragment of the moments after their
    # first step only; link the moments just made so that the fragment writes below reach them
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _optimizer_params(engine, optimizer) -> list[torch.Tensor]:
    """The tensors the torch optimizer keeps state for: its param groups', and ZeRO-3's fp32
    partitions, which it puts into the groups only during its step (a state restored into a
    fresh ZeRO-3 engine needs their moments before any step made them)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    params += getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or []
    unique = {id(param): param for param in params}
    return list(unique.values())


def _ensure_state(optimizer, param) -> dict:
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        for key in MOMENTS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


# ----------------------------------------------------------------------------- checkpoints

STATE_FILE = "layout_free_state.pt"


def save_layout_free_checkpoint(
    engine, comm, directory: Path, tag: str, client: dict, base: dict | None = None
) -> None:
    """`gather_state` (collective) written by rank 0 as directory/tag/STATE_FILE with the
    worker's `client` state, atomically: a temporary folder renamed into place, then `latest`.
    `base` (a LoRA run: the base model's spec and content hash) goes beside it."""
    state = gather_state(engine)
    if comm.rank == 0:
        staging, final = directory / f".{tag}.tmp", directory / tag
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        torch.save({"training": state, "client": client}, staging / STATE_FILE)
        if base is not None:
            write_text_atomic(staging / LORA_BASE_FILE, json.dumps(base))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        write_text_atomic(directory / "latest", tag)
    comm.barrier()


def load_layout_free_checkpoint(
    engine, directory: Path, tag: str | None, base: dict | None = None
) -> tuple[str, dict]:
    """(path loaded, client state) of `save_layout_free_checkpoint`'s checkpoint, restored into
    this engine whatever its layout; ValueError naming what is missing, or (`base`: a LoRA
    run's) when its adapters were trained on another base, checked before anything is loaded."""
    check_base(directory, tag, base)
    latest = directory / "latest"
    if tag is None and not latest.is_file():
        raise ValueError(f"no checkpoint in {str(directory)!r} (no 'latest')")
    path = directory / (tag or latest.read_text().strip()) / STATE_FILE
    if not path.is_file():
        raise ValueError(
            f"{str(path)!r} does not exist: a layout-invariant run resumes from its layout-free "
            "state (was the checkpoint written with trainer.layout_invariant: false?)"
        )
    saved = torch.load(path, weights_only=True)
    restore_state(engine, saved["training"])
    client = saved["client"]
    engine.global_steps = int(client.get("rl_engine_step", 0))
    return str(path), client
