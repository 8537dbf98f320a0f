"""What the driver does when something goes wrong: a dead or failing actor, Ctrl-C, SIGTERM.

- `gather(calls)` waits for a set of actor calls and raises `ActorFailure` as soon as ANY
  of them fails, naming that actor (role, rank, node, pid) and the cause in one line. It
  never blocks on a live rank that waits in a collective for a dead one. When a call
  raises, the others get `DEATH_GRACE_S` to show whether an actor died: a peer's death
  makes its partners raise at once (gloo's "Connection closed by peer" in a weight sync),
  and the message must name the dead actor, not the ones that saw it go.
- `StopOnSignal` turns SIGINT / SIGTERM into a request honoured at the end of the current
  step (checkpoint, then exit 130 / 143); a second signal stops at once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

log = logging.getLogger("rl_engine.job")

DEATH_GRACE_S = 5.0
"""After a call raises, how long gather waits for the others to show an actor death."""
KILL_IN_WEIGHT_SYNC_ENV = "RL_ENGINE_TEST_KILL_IN_WEIGHT_SYNC"


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
    env: dict = field(default_factory=dict)  # what it got of `cluster.actor_env`
    tp_rank: int | None = None  # a tensor-parallel engine's rank (None: not tensor parallel)

    @property
    def name(self) -> str:
        tp = "" if self.tp_rank is None else f" tp rank {self.tp_rank}"
        return f"{self.role} {self.rank}{tp}"

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
            "env": self.env,
        } | ({} if self.tp_rank is None else {"tp_rank": self.tp_rank})


class ActorFailure(RuntimeError):
    """An actor died or raised; the message is one line naming it and the cause."""


class JobStopped(RuntimeError):
    """The job ended early (signal or failure); `exit_code` is what the command returns."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def gather(calls: list[tuple[ActorInfo, ray.ObjectRef]]) -> list:
    """Results of `calls` in order; the first failure raises ActorFailure (an actor's death
    before any other failure: see the module docstring)."""
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
                raised = f"{actor.describe()} raised {_task_error(err)}"
                raise ActorFailure(_death_among(calls, index, pending, raised)) from None
    return results


def _task_error(err: RayTaskError) -> str:
    cause = err.cause if isinstance(err.cause, BaseException) else err
    return f"{type(cause).__name__}: {first_line(str(cause))}"


def _death_among(calls, index: dict, pending: list, raised: str) -> str:
    """The failure to report once a call raised: an actor among the pending calls that died
    within DEATH_GRACE_S (then `raised` follows as what it caused), else `raised`."""
    if not pending:
        return raised
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as err:
            dead = calls[index[ref]][0]
            return f"{dead.describe()} died: {death_cause(err)} (then {raised})"
        except RayTaskError:
            continue
    return raised


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


def weight_sync_kill_switch(actor_name: str):
    """Testing only: with RL_ENGINE_TEST_KILL_IN_WEIGHT_SYNC="<actor name>@<version>" (e.g.
    "rollout engine 0@2") that actor SIGKILLs its own process once the first bucket of the
    sync to that version is through: a real death at the one moment of a sync that a test
    cannot hit from outside. Returns the sync's `on_bucket` hook, or None."""
    spec = os.environ.get(KILL_IN_WEIGHT_SYNC_ENV, "")
    name, _, version = spec.rpartition("@")
    if name != actor_name or not version.isdigit():
        return None

    def on_bucket(sync_version: int, bucket: int) -> None:
        if sync_version == int(version) and bucket == 0:
            log.warning("%s: %s: killing this process", KILL_IN_WEIGHT_SYNC_ENV, spec)
            os.kill(os.getpid(), signal.SIGKILL)

    return on_bucket


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
