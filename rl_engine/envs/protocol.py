"""What an environment is (`Environment`), how it is loaded, and how each of its calls is made.

A user writes one class in one file and names it in `rollout.env` (`path/to/file.py:Class` or
`module:Class`, loaded by `rl_engine.rewards.load_class`, the loader of every plug-in):

    class MyEnv:
        def __init__(self, **env_args): ...          # one instance per episode
        def reset(self, record):                     # -> None | prompt
            ...
        def step(self, turn):                        # -> (observation, reward, done)
            ...

- `record`: `prompt_ids` (list[int]) and, where the task or dataset has them, `prompt`
  (text), `answer` and `extra_info` (None otherwise). `reset` returns None to keep the
  prompt, or the episode's own prompt: token ids, text (one user turn) or chat messages.
- `turn`: `completion_ids` (the model's turn, list[int]) and `completion` (its text, or None
  without a tokenizer). `step` returns the observation (None, text, or a list of token ids;
  ignored when `done`), the turn's reward (a finite number) and `done`.

Every call (the constructor, `reset`, `step`) runs under `rollout.env_timeout_s` with the
reward workers' rules (`call_env`): a raise, a result of the wrong form or a timeout never
stops the job; it comes back as a `Call` with `error` / `timed_out` set, which the episode
counts (env/errors, env/timeouts), scores 0 and ends on. The timer interrupts Python code and
sleeps in the driver's main thread (`rl_engine.rewards` time_limit), not a C call that never
returns to the interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Protocol

from rl_engine.rewards import RewardTimeout, load_class
from rl_engine.rewards.scoring import time_limit

ENV_FORMS = "path/to/file.py:Class or module:Class"


class Environment(Protocol):
    """The protocol of `rollout.env`'s class (see the module docstring)."""

    def reset(self, record: dict) -> None | list[int] | str | list[dict]: ...

    def step(self, turn: dict) -> tuple[None | str | list[int], float, bool]: ...


def load_environment(spec: str) -> type:
    """The class `rollout.env` names; RewardSpecError (a ValueError) says which part is wrong."""
    cls = load_class(spec, "rollout.env", forms=ENV_FORMS)
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(
            f"rollout.env {spec!r}: {cls.__name__} has no {' or '.join(missing)} method "
            "(an environment defines reset(record) and step(turn))"
        )
    return cls


@dataclass(frozen=True, slots=True)
class Call:
    """One call of the environment: its checked value, or what went wrong."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def call_env(what: str, fn: Callable, *args, timeout_s: float, check=None) -> Call:
    """`fn(*args)` under the time limit, its result passed through `check` (which raises
    TypeError / ValueError for a result of the wrong form); never raises for the environment's
    own failures."""
    try:
        with time_limit(timeout_s):
            value = fn(*args)
        if check is not None:
            value = check(value)
    except RewardTimeout:
        return Call(
            error=f"{what} took more than rollout.env_timeout_s = {timeout_s:g} s", timed_out=True
        )
    except Exception as err:  # the user's environment: counted and scored, never fatal here
        return Call(error=f"{what}: {type(err).__name__}: {err}"[:300])
    return Call(value)


def check_step(result) -> tuple[Any, float, bool]:
    """`step`'s (observation, reward, done) with reward a finite float and done a bool."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise TypeError(f"step must return (observation, reward, done), got {result!r:.120}")
    observation, reward, done = result
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise ValueError(f"step's reward must be a finite number, got {reward!r:.80}")
    if done not in (True, False):
        raise TypeError(f"step's done must be true or false, got {done!r:.80}")
    return observation, float(reward), bool(done)


def is_token_list(value) -> bool:
    """A list or tuple of int token ids (numpy ints too; not bools)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, Integral) and not isinstance(t, bool) for t in value
    )
