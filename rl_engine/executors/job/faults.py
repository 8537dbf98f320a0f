"""What the driver does when something goes wrong: a dead or failing actor, Ctrl-C, SIGTERM.

- `gather(calls)` waits for a set of actor calls and raises `ActorFailure` as soon as ANY
  of them fails, naming that actor (role, rank, node, pid) and the cause in one line. It
  never blocks on a live rank that waits in a collective for a dead one.
- `StopOnSignal` turns SIGINT / SIGTERM into a request honoured at the end of the current
  step (checkpoint, then exit 130 / 143); a second signal stops at once.
"""

from __future__ import annotations

import logging
import re
import signal
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

log = logging.getLogger("rl_engine.job")


@dataclass
class ActorInfo:
    """One actor of the job and where it runs (node and pid filled in once it answers)."""

    role: str
    rank: int
    handle: object
    node_ip: str = "?"
    node_id: str = "?"
    pid: int | None = None
    facts: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"

    def describe(self) -> str:
        return f"{self.name} (node {self.node_ip} {self.node_id[:8]}, pid {self.pid})"

    def as_dict(self) -> dict:
        return {
            "role": self.role,
            "rank": self.rank,
            "node_ip": self.node_ip,
            "node_id": self.node_id,
            "pid": self.pid,
            "facts": self.facts,
        }


class ActorFailure(RuntimeError):
    """An actor died or raised; the message is one line naming it and the cause."""


class JobStopped(RuntimeError):
    """The job ended early (signal or failure); `exit_code` is what the command returns."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def gather(calls: list[tuple[ActorInfo, ray.ObjectRef]]) -> list:
    """Results of `calls` in order; the first failure (in completion order) raises ActorFailure."""
    index = {ref: i for i, (_, ref) in enumerate(calls)}
    results = [None] * len(calls)
    pending = list(index)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            actor = calls[index[ref]][0]
            try:
                results[index[ref]] = ray.get(ref)
            except RayActorError as err:
                raise ActorFailure(f"{actor.describe()} died: {death_cause(err)}") from None
            except RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                raise ActorFailure(
                    f"{actor.describe()} raised {type(cause).__name__}: {first_line(str(cause))}"
                ) from None
    return results


def death_cause(err: RayActorError) -> str:
    """Ray's (multi-line) actor-death message cut to what says why."""
    text = " ".join(str(err).split())
    detail = re.search(
        r"Worker exit type: (\S+) Worker exit detail: (.*?)(?: Some common causes|$)", text
    )
    if detail:
        return f"its process exited ({detail.group(1)}: {detail.group(2).strip()})"
    return first_line(text.split(" Some common causes")[0])


def first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines and lines[0].startswith("ray::") else (lines[0] if lines else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def stop_actors(actors: list[ActorInfo]) -> None:
    """Kill every actor (a rank blocked in a collective would otherwise wait for its timeout)."""
    for actor in actors:
        try:
            ray.kill(actor.handle, no_restart=True)
        except Exception as err:  # already dead: nothing to stop
            log.debug("kill %s: %s", actor.name, err)


class StopOnSignal:
    """SIGINT / SIGTERM request a stop at the end of the current step; a second one stops now."""

    EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self) -> StopOnSignal:
        for signum in self.EXIT_CODES:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning(
            "%s received: stopping at the end of this step (again to stop at once)",
            signal.Signals(signum).name,
        )

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES[self.signum]
