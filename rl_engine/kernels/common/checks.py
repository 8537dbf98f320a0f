"""Input validation shared by every backend: errors name the tensor and the value."""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit floats and fp32; fp64 stays fp64 (so gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


def check_floating(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_last_dim(name: str, t: torch.Tensor, size: int, what: str) -> None:
    if t.shape[-1] != size:
        raise ValueError(
            f"{name} has last dim {t.shape[-1]} but {what} is {size} (shape {tuple(t.shape)})"
        )


def check_same_dtype(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} is {a.dtype} but {name_b} is {b.dtype}; cast one of them")


def check_projection(name: str, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """x (..., K) against weight (N, K) and an optional bias (N,)."""
    check_floating(name, x)
    check_floating("weight", weight)
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    check_last_dim(name, x, weight.shape[1], "weight's in_features")
    check_same_dtype(name, x, "weight", weight)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def check_index_range(name: str, idx: torch.Tensor, size: int, what: str, *, ignore=None) -> None:
    """Integer ids must lie in [0, size), except entries equal to `ignore`."""
    if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name} must be an integer tensor, got dtype {idx.dtype}")
    if idx.numel() == 0:
        return
    live = idx if ignore is None else idx[idx != ignore]
    if live.numel() == 0:
        return
    lo, hi = int(live.min()), int(live.max())
    if lo < 0 or hi >= size:
        allowed = f"[0, {size - 1}]" + ("" if ignore is None else f" or {ignore}")
        raise ValueError(
            f"{name} out of range: min {lo}, max {hi}, but {what} is {size} (allowed {allowed})"
        )


def check_embedding(ids: torch.Tensor, weight: torch.Tensor) -> None:
    """weight (V, H) floating, ids integers in [0, V)."""
    check_floating("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"embedding weight must be 2-D (vocab, hidden), got {tuple(weight.shape)}")
    check_index_range("token ids", ids, weight.shape[0], "the vocabulary size")


def check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature
