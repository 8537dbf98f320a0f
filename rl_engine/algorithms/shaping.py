"""Reward shaping that depends on the completion, not on the task: DAPO's soft overlong penalty."""

from __future__ import annotations

from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_length: int, buffer: int, factor: float) -> Tensor:
    """(B,) DAPO's soft overlong punishment (Yu et al. 2025), added to each sequence's reward.

    With L = `max_length` (the completion-token limit) and C = `buffer`, a completion of
    |y| tokens gets 0 when |y| <= L - C, a penalty growing linearly to -`factor` over the
    last C tokens, `factor` * (L - C - |y|) / C, and -`factor` beyond L (a completion the
    engine cut off at the limit has |y| = L and gets the full -`factor`).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be an int in [1, max_length = {max_length}], got {buffer!r}")
    if not float(factor) >= 0:
        raise ValueError(f"factor must be >= 0, got {factor!r}")
    if not isinstance(lengths, Tensor) or lengths.dim() != 1:
        raise ValueError("lengths must be a 1-D (B,) tensor of completion lengths")
    excess = lengths.float() - (max_length - buffer)  # > 0: inside the buffer or beyond
    penalty = -factor * excess.clamp(min=0.0) / buffer
    return penalty.clamp(min=-float(factor))
