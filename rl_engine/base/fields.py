"""Checks of typed config fields: one wording for every ValueError a config dataclass raises.

`check_int("trainer.micro_batch_size", 0, 1)` raises
`ValueError("trainer.micro_batch_size must be an int >= 1, got 0")`: the name, what it must be,
the value. The run config's sections (rl_engine.config) and the engine's SamplingParams
(rl_engine.rollout.sampling, which shares its sampling keys with the `rollout:` section) both
check with these. Plain Python below every layer, so the rollout layer uses them without
importing rl_engine.config, which sits above it.
"""

from __future__ import annotations

import math
from typing import Any

BOOLS = (True, False)


def fail(name: str, requirement: str, value: Any) -> None:
    """Raise the one ValueError of an invalid field: '<name> must be <requirement>, got <value>'."""
    raise ValueError(f"{name} must be {requirement}, got {value!r}")


def is_int(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, never to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int) -> None:
    """An int (not a bool) >= minimum."""
    if not is_int(value) or value < minimum:
        fail(name, f"an int >= {minimum}", value)


def check_number(
    name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    """A finite int or float (not a bool) in [low, high], or in (low, high] with low_open."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"> {low}" if low_open else f">= {low}"
        fail(
            name,
            f"a finite number {bound}" + ("" if high == math.inf else f" and <= {high}"),
            value,
        )


def check_choice(name: str, value: Any, options: tuple) -> None:
    """One of `options`, of the same type (1 is not True, 1.0 is not 1)."""
    if not any(value is o or (type(value) is type(o) and value == o) for o in options):
        fail(name, "true or false" if options == BOOLS else f"one of {list(options)}", value)


def check_bool(name: str, value: Any) -> None:
    """True or False (not 1, not 'yes')."""
    check_choice(name, value, BOOLS)


def check_text(name: str, value: Any) -> None:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        fail(name, "a non-empty string", value)
