"""Calling a verl-style reward on one sample: time limit, result checks, and what went wrong.

`call_score(fn, sample, kwargs, timeout_s)` never raises for the reward's own failures:
a raise, a result that is not a finite number (or a dict with a numeric 'score'), or
running past `timeout_s` come back as a `Score` with `error` / `timed_out` set and value 0.
What the step does with those (score 0 and count them, or fail) is `check_scores`.

The time limit in this process: a watchdog thread signals the main thread (SIGUSR2, a
signal no reward library claims; math-verify's own `signal.alarm` would cancel an
ITIMER_REAL) and the handler raises `RewardTimeout`, a BaseException so that a reward's
`except Exception` cannot swallow it. It interrupts Python code and sleeps, not a C call
that never returns to the interpreter: the Ray reward workers (`reward.num_workers`)
are also killed and replaced when they overrun, so nothing can hang the job.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_TIMEOUT_SIGNAL = signal.SIGUSR2


@dataclass(slots=True)
class RewardSample:
    """The arguments of verl's compute_score for one completion."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Any = None
    where: str = ""
    """Which prompt and completion (for error messages)."""


@dataclass(slots=True)
class Score:
    """One sample's outcome: `value` is the reward the step uses (0 on error / timeout)."""

    value: float
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class RewardTimeout(BaseException):
    """Raised inside a reward that ran past its time limit (BaseException: not swallowed)."""


class RewardFailure(RuntimeError):
    """A reward raised or timed out under reward.on_error: fail (the job stops, exit 1)."""


def normalize(result) -> tuple[float, dict[str, float]]:
    """verl's result forms -> (score, numeric extras); TypeError/ValueError for anything else."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key: {sorted(result)}")
        extras = {
            str(k): float(v)
            for k, v in result.items()
            if k != "score" and _is_number(v) and math.isfinite(float(v))
        }
        result = result["score"]
    if not _is_number(result):
        raise TypeError(f"returned {type(result).__name__} {result!r:.80}, not a number")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite score {value}")
    return value, extras


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return True  # verl rewards often return True / False
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return np.issubdtype(type(value), np.number) or isinstance(value, np.bool_)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return isinstance(value, (int, float))


def call_score(fn: Callable, sample: RewardSample, kwargs: dict, timeout_s: float) -> Score:
    """fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **kwargs) as a Score."""
    try:
        with time_limit(timeout_s):
            result = fn(
                data_source=sample.data_source,
                solution_str=sample.solution_str,
                ground_truth=sample.ground_truth,
                extra_info=sample.extra_info,
                **kwargs,
            )
        value, extras = normalize(result)
    except RewardTimeout:
        return Score(
            0.0, timed_out=True, error=f"took more than reward.timeout_s = {timeout_s:g} s"
        )
    except Exception as err:  # the user's reward: any failure is counted, never fatal here
        return Score(0.0, error=f"{type(err).__name__}: {err}"[:300])
    return Score(value, extras)


class _Watch:
    """The sample being timed in the main thread and the one whose time ran out (tokens)."""

    current: object | None = None
    expired: object | None = None
    installed = False


def _on_timeout_signal(signum, frame) -> None:
    # A signal that arrives late (its sample already finished) finds another or no token.
    if _Watch.current is not None and _Watch.expired is _Watch.current:
        _Watch.current = None
        raise RewardTimeout


def _expire(token: object) -> None:
    if _Watch.current is token:
        _Watch.expired = token
        signal.pthread_kill(threading.main_thread().ident, _TIMEOUT_SIGNAL)


@contextmanager
def time_limit(seconds: float):
    """RewardTimeout in this (main) thread after `seconds`; no limit off the main thread.

    The handler is installed once and stays: restoring the default action of SIGUSR2
    (terminate) could let a watchdog's late signal kill the process.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _Watch.installed:
        signal.signal(_TIMEOUT_SIGNAL, _on_timeout_signal)
        _Watch.installed = True
    token = object()
    _Watch.current = token
    watchdog = threading.Timer(seconds, _expire, args=(token,))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        _Watch.current = None
        watchdog.cancel()


def check_scores(
    scores: list[Score], samples: list[RewardSample], on_error: str, what: str
) -> None:
    """Under on_error 'fail', raise RewardFailure naming the first sample that raised or timed out."""
    if on_error != "fail":
        return
    for score, sample in zip(scores, samples):
        if not score.ok:
            raise RewardFailure(
                f"{what} of {sample.where} (data_source {sample.data_source!r}) failed: "
                f"{score.error} (reward.on_error: fail)"
            )


def score_metrics(scores: list[Score], prefix: str = "reward/") -> dict[str, float]:
    """Counts of errors and timeouts, and the mean of each numeric extra a dict result carried."""
    metrics = {
        f"{prefix}errors": float(sum(1 for s in scores if s.error is not None and not s.timed_out)),
        f"{prefix}timeouts": float(sum(1 for s in scores if s.timed_out)),
    }
    names = sorted({k for s in scores for k in s.extras})
    for name in names:
        values = [s.extras[name] for s in scores if name in s.extras]
        metrics[f"{prefix}extra/{name}"] = sum(values) / len(values)
    return metrics
