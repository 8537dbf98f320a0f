"""A long-lived helper process that answers requests one at a time, for work whose start (an
interpreter, its imports) costs more than the work: the thread-count workers
(tests/helpers/thread_worker.py) and the vLLM engine hosts (tests/helpers/rollout/vllm).

Protocol, on the pipes the parent opened: a request is an 8-byte big-endian length and a
pickled payload on the child's stdin; the answer is the same framing on the child's original
stdout, a pickled ("ok", result) or ("error", traceback text). The child's own prints go to
its stderr, so they never corrupt a frame.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable

_HEADER = struct.Struct(">Q")


def read_frame(stream) -> bytes | None:
    """One length-prefixed frame, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return stream.read(_HEADER.unpack(header)[0])


def write_frame(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def serve(handle: Callable) -> None:
    """The child's loop: `handle(request)` for each request until stdin closes."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    while (frame := read_frame(requests)) is not None:
        try:
            answer = pickle.dumps(("ok", handle(pickle.loads(frame))))
        except BaseException:  # the parent decides what a failure means (skip or raise)
            answer = pickle.dumps(("error", traceback.format_exc()))
        write_frame(answers, answer)


class FramedProcess:
    """The parent's side: one child (`command`), kept until `close`. `stderr`: where the
    child's own output goes (None: this process's stderr)."""

    def __init__(self, command: list[str], *, cwd, env: dict[str, str], stderr=None):
        self.name = " ".join(command[-2:])
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, payload, timeout: float) -> tuple[str, object]:
        """("ok", result) or ("error", traceback); RuntimeError when the child died or ran
        past `timeout` (a timer kills it: the read then ends)."""
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            write_frame(self.proc.stdin, pickle.dumps(payload))
            frame = read_frame(self.proc.stdout)
        finally:
            timer.cancel()
        if frame is None:
            raise RuntimeError(
                f"helper process ({self.name}) died or ran past {timeout:.0f} s "
                f"(exit code {self.proc.poll()})"
            )
        return pickle.loads(frame)

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
