"""A long-lived interpreter at one intra-op thread count, for `tests.helpers.invariance.run_with_threads`.

`python -m tests.helpers.thread_worker N` sets N threads once, then runs snippets sent on stdin, one at
a time, each in a namespace of its own with torch's global RNG seeded to 0 (the same in every
worker; a fresh interpreter seeds it at random): what a `python -c` at N threads computes, without paying the interpreter's start and the imports
(torch, transformers, the C++ kernels: 3-6 s a process) for every snippet.

Protocol (binary, on the fds the parent opened): a request is an 8-byte big-endian length and a
pickled snippet (str) on stdin; the answer is the same framing on the original stdout, a pickled
("ok", result) or ("error", traceback text). The snippet's own prints go to stderr.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback

import torch

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


def _run(snippet: str, threads: int):
    torch.set_num_threads(threads)  # an earlier snippet may have changed it
    torch.manual_seed(0)  # nor does an earlier snippet's RNG use carry over
    namespace = {"__name__": "__thread_snippet__", "torch": torch, "pickle": pickle, "sys": sys}
    exec(compile(snippet, "<snippet>", "exec"), namespace)
    return namespace["result"]


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # snippet output must not corrupt frames
    requests = sys.stdin.buffer
    while (frame := read_frame(requests)) is not None:
        try:
            answer = pickle.dumps(("ok", _run(pickle.loads(frame), threads)))
        except BaseException:  # the parent decides what a failure means (skip or raise)
            answer = pickle.dumps(("error", traceback.format_exc()))
        write_frame(answers, answer)


if __name__ == "__main__":
    main(int(sys.argv[1]))
