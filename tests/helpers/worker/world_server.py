"""One long-lived DeepSpeed world per world size per pytest process ("world server").

A rank start costs ~5-6 CPU s (torch, transformers, DeepSpeed, the gloo rendezvous), far
more than most runs: the ranks of a `WorldServer` (`ds_runner.py --serve`) start and
rendezvous once, then run one spec per request from a fresh rank's state (ds_runner's
`_fresh_process_state`), writing the same result files in the request's out_dir as a
launch of their own. A request sends the spec's path as a line on every rank's stdin; a
rank acknowledges with a line on its stdout (its prints go to logs, see ds_runner). On any
error the server is killed (its ranks may wait in a collective forever) and the next
request starts a fresh one. The servers are closed when the pytest process exits (atexit;
stdin EOF also ends ranks whose parent died).
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_engine.executors.worker.distributed import free_port

RUNNER = Path(__file__).with_name("ds_runner.py")
ACK = b"done\n"
CLOSE_GRACE_S = 5.0
# No rank reads these, so a change is no reason to start a fresh world: pytest changes the first
# every test, and Ray's first `ray.init` in the process sets the others (Ray 2.60).
UNREAD_ENV = {"PYTEST_CURRENT_TEST", "PYTHONBREAKPOINT", "RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED"}

_servers: dict[int, WorldServer] = {}


class WorldServer:
    """The `world` rank processes of one server, and the environment they were started in."""

    def __init__(self, world: int, env_of_rank) -> None:
        self.world = world
        self.started_in = process_context()
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"world{world}-server-"))
        port = free_port()
        self.procs = [self._start(rank, env_of_rank(rank, world, port)) for rank in range(world)]

    def _start(self, rank: int, env: dict) -> subprocess.Popen:
        with open(self.log_dir / f"rank{rank}.log", "w") as log:
            return subprocess.Popen(
                [sys.executable, str(RUNNER), "--serve"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )

    def request(self, spec_path: Path, out_dir: Path, timeout: float) -> str | None:
        """Run the spec on every rank; None, or the error text of a launch of its own."""
        try:
            for proc in self.procs:
                proc.stdin.write(f"{spec_path}\n".encode())
                proc.stdin.flush()
        except BrokenPipeError:  # a rank ended while idle: its error, as a launch's failure
            return self._error_of_ended(out_dir)
        return self._wait_acks(out_dir, timeout)

    def _wait_acks(self, out_dir: Path, timeout: float) -> str | None:
        """Block (select, no polling) until every rank acknowledged, one ended, or `timeout`."""
        deadline = time.monotonic() + timeout
        waiting = {proc.stdout.fileno(): rank for rank, proc in enumerate(self.procs)}
        while waiting:
            left = deadline - time.monotonic()
            ready = select.select(list(waiting), [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                return f"ranks did not finish within {timeout:.0f} s; see {out_dir}/rank*.log"
            for fd in ready:
                line = os.read(fd, len(ACK))  # a rank writes nothing else on this pipe
                if line != ACK:  # EOF: the rank ended
                    return self._error_of_ended(out_dir)
                del waiting[fd]
        return None

    def _error_of_ended(self, out_dir: Path) -> str:
        """The lowest failed rank's error, as a launch of its own reports it."""
        codes = [_code_soon(proc) for proc in self.procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        ended = [rank for rank, code in enumerate(codes) if code is not None]
        rank = (failed or ended or [0])[0]
        return error_text(out_dir, rank, codes[rank], self.log_dir / f"rank{rank}.log")

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            _close_pipes(proc)
        shutil.rmtree(self.log_dir, ignore_errors=True)  # a failure's text is taken already

    def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """stdin EOF ends each rank's loop; a rank still there after `grace` s is killed."""
        for proc in self.procs:
            _close_pipes(proc)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def _code_soon(proc: subprocess.Popen, wait_s: float = 2.0) -> int | None:
    """The exit code of a rank whose pipe closed (it is exiting), None if it lives on."""
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return None


def _close_pipes(proc: subprocess.Popen) -> None:
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:  # a dead rank's stdin: the flush of nothing fails, the close is done
            pass


def error_text(out_dir: Path, rank: int, code: int | None, server_log: Path | None = None) -> str:
    """A failed rank's `.error`, else the tail of its log (the request's, else the server's)."""
    error, log = out_dir / f"rank{rank}.error", out_dir / f"rank{rank}.log"
    if error.is_file():
        detail = error.read_text()
    else:
        log = log if log.is_file() or server_log is None else server_log
        detail = log.read_text()[-4000:] if log.is_file() else f"no {log}"
    return f"rank {rank} failed (exit {code}):\n{detail}"


def process_context() -> tuple:
    """What a rank inherits from this process at its start (environment, working folder)."""
    env = {key: value for key, value in os.environ.items() if key not in UNREAD_ENV}
    return tuple(sorted(env.items())), os.getcwd()


def serve(spec_path: Path, world: int, out_dir: Path, timeout: float, env_of_rank) -> str | None:
    """Run the spec on this process's server of `world` ranks (started on first use, or again
    when this process's environment changed since); kill the server on any error."""
    server = _servers.get(world)
    if server is not None and (server.started_in != process_context() or not server.alive()):
        _servers.pop(world).kill()
        server = None
    if server is None:
        server = _servers[world] = WorldServer(world, env_of_rank)
    try:
        error = server.request(spec_path, out_dir, timeout)
    except BaseException:  # an interrupt mid-request: the ranks may be in a collective
        _servers.pop(world).kill()
        raise
    if error is not None:
        _servers.pop(world).kill()
    return error


def server_pids(world: int) -> list[int]:
    """The rank processes of this process's live server of `world` ranks ([] if none)."""
    server = _servers.get(world)
    return [proc.pid for proc in server.procs] if server is not None else []


@atexit.register
def close_all() -> None:
    """At exit of the pytest process (each xdist worker has its own servers): an atexit hook
    and not a session fixture, so every caller of `run_ranks` (also scripts) is covered
    without a fixture to request, and conftest stays as it is."""
    while _servers:
        _servers.popitem()[1].close()
