"""The DeepSpeed config of a run: the user's, completed from the run config and validated."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from rl_engine.config import RunConfig

# ZeRO-3 settings the worker fills in when the user's DeepSpeed config leaves them out.
# DeepSpeed's own defaults are sized for GPUs with memory to spare; on a host they cost
# more than the model states themselves (measured on the Qwen2.5-0.5B-shaped job,
# docs/benchmarks.md). None of them changes a forward's bits.
ZERO3_MEMORY_DEFAULTS = {
    # gradient bucket (IPG) elements: DeepSpeed's 5e8 allocates a 1 GB bf16 buffer per rank,
    # which one backward of a model up to 0.5B parameters fills entirely; 1e7 is 19 MiB (bf16)
    # and took no longer a step on the 0.5B shape than 5e7
    "reduce_bucket_size": 10_000_000,
    # optimizer step per sub-group of at most this many elements: the step makes a flat fp32
    # copy of each sub-group's gradients (DeepSpeed's 1e9: the rank's whole partition at once);
    # a sub-group holds whole parameters, so a larger parameter's partition is one sub-group
    "sub_group_size": 50_000_000,
    # gathered parameters kept between uses: with DeepSpeed's 1e9 every parameter is reused
    # "soon" (in the backward), so a forward ends with the whole model gathered on every rank
    "stage3_max_live_parameters": 30_000_000,
    "stage3_max_reuse_distance": 30_000_000,
    # parameters gathered ahead of their use: DeepSpeed's 5e7 kept about 11 layers of the
    # 0.5B shape gathered ahead in the backward (rank RSS swinging 200 MB layer by layer)
    "stage3_prefetch_bucket_size": 10_000_000,
}


def load_deepspeed_config(spec: dict | str) -> dict:
    """A deep copy of the user's DeepSpeed config (a dict, or a path to a JSON file)."""
    if isinstance(spec, dict):
        return copy.deepcopy(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"trainer.deepspeed: DeepSpeed config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"trainer.deepspeed: {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"trainer.deepspeed: {str(path)!r} must hold a JSON object")
    return data


def build_deepspeed_config(config: RunConfig, world_size: int) -> dict:
    """The DeepSpeed config for `config`: the user's, with batch sizes, clipping and bf16 filled in.

    Raises ValueError naming the key for anything DeepSpeed would reject or that
    contradicts the run config; a key present in both must agree.
    """
    if world_size != config.trainer.num_ranks:
        raise ValueError(
            f"trainer.num_ranks={config.trainer.num_ranks} but WORLD_SIZE={world_size}"
        )
    ds = load_deepspeed_config(config.trainer.deepspeed)
    _reject_unsupported(ds)
    _set_bf16(ds, config.dtype)
    micro, accum = config.trainer.micro_batch_size, config.gradient_accumulation_steps
    budget = config.trainer.ragged_micro_batches
    # With a token budget (or layout_invariant) the micro-batch count varies per step: the worker marks each
    # optimizer step's last micro-batch (set_gradient_accumulation_boundary) and DeepSpeed's
    # count is 1. One optimizer step is one mini-batch (trainer.mini_batch_size).
    _fill(ds, "train_micro_batch_size_per_gpu", micro, "trainer.micro_batch_size")
    _fill(
        ds,
        "gradient_accumulation_steps",
        accum,
        "trainer.max_tokens_per_micro_batch or trainer.layout_invariant: 1, the worker sets "
        "each step's boundary"
        if budget
        else "sequences per optimizer step (trainer.mini_batch_size, default the whole step) / "
        "(micro_batch_size x num_ranks)",
    )
    _fill(
        ds,
        "train_batch_size",
        micro * accum * world_size,
        "trainer.micro_batch_size x num_ranks under a token budget"
        if budget
        else "trainer.mini_batch_size, or rollout.prompts_per_step x samples_per_prompt",
    )
    if config.trainer.layout_invariant:
        # the worker clips by the layout-free norm and steps its own elementwise AdamW
        _fill(ds, "gradient_clipping", 0.0, "0 under trainer.layout_invariant: the worker clips")
        ds.setdefault("zero_allow_untested_optimizer", True)
    else:
        _fill(ds, "gradient_clipping", float(config.trainer.grad_clip), "trainer.grad_clip")
    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"deepspeed.zero_optimization must be an object, got {zero!r}")
    if config.trainer.zero_stage is not None:
        zero["stage"] = config.trainer.zero_stage
    zero.setdefault("stage", 0)
    if zero["stage"] == 3:
        for key, value in ZERO3_MEMORY_DEFAULTS.items():
            zero.setdefault(key, value)
    return ds


def _reject_unsupported(ds: dict, prefix: str = "deepspeed.") -> None:
    for key, value in ds.items():
        if value == "auto":
            raise ValueError(
                f"{prefix}{key} is 'auto': give a value (the worker fills batch sizes, clipping, bf16)"
            )
        if isinstance(value, dict):
            _reject_unsupported(value, f"{prefix}{key}.")
    if prefix != "deepspeed.":
        return
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(
                f"deepspeed.{key} is not supported: the worker builds torch AdamW from trainer.lr / "
                "trainer.weight_decay; remove the key"
            )
    if _section(ds, "fp16").get("enabled", False):
        raise ValueError(
            "deepspeed.fp16.enabled: fp16 is not supported; use dtype: bfloat16 (or float32)"
        )


def _section(ds: dict, name: str) -> dict:
    value = ds.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"deepspeed.{name} must be an object, got {value!r}")
    return value


def _set_bf16(ds: dict, dtype: str) -> None:
    want = dtype == "bfloat16"
    key = "bfloat16" if "bfloat16" in ds else "bf16"  # DeepSpeed accepts the old name too
    section = _section(ds, key)
    enabled = section.get("enabled", want)
    if not isinstance(enabled, bool):
        raise ValueError(f"deepspeed.{key}.enabled must be true or false, got {enabled!r}")
    if enabled != want:
        raise ValueError(
            f"deepspeed.{key}.enabled is {enabled} but dtype is {dtype!r}: they must agree "
            f"(bf16 on exactly when dtype is 'bfloat16')"
        )
    ds[key] = {**section, "enabled": want}


def _fill(ds: dict, key: str, value, source: str) -> None:
    if key not in ds:
        ds[key] = value
        return
    given = ds[key]
    numeric = isinstance(given, (int, float)) and not isinstance(given, bool)
    if not numeric or given != value:
        raise ValueError(
            f"deepspeed.{key} = {given!r} contradicts the run config ({source} gives {value!r}); "
            "remove the key or make them agree"
        )


def validate_with_deepspeed(ds: dict) -> None:
    """Let DeepSpeed parse the config now, so a rejection is a ValueError before any engine exists."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    try:
        DeepSpeedConfig(copy.deepcopy(ds))
    except ValidationError as err:
        problems = "; ".join(
            f"{_dotted_key(ds, e['loc'])}: {e['msg']} (got {e.get('input')!r})"
            for e in err.errors()
        )
        raise ValueError(f"DeepSpeed rejected the config: {problems}") from None
    except (
        AssertionError,
        ValueError,
        TypeError,
        KeyError,
    ) as err:  # DeepSpeed checks batch sizes with assert
        raise ValueError(f"DeepSpeed rejected the config: {err}") from err


def _dotted_key(ds: dict, loc: tuple) -> str:
    """'deepspeed.<section>.<key>' for a pydantic error location inside one of the config's sections."""
    key = ".".join(str(part) for part in loc)
    sections = [
        name for name, value in ds.items() if isinstance(value, dict) and loc and loc[0] in value
    ]
    return f"deepspeed.{sections[0]}.{key}" if sections else f"deepspeed.{key}"
