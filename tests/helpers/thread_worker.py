"""A long-lived interpreter at one intra-op thread count, for `tests.helpers.invariance.run_with_threads`.

`python -m tests.helpers.thread_worker N` sets N threads once, then runs snippets sent on stdin, one at
a time, each in a namespace of its own with torch's global RNG seeded to 0 (the same in every
worker; a fresh interpreter seeds it at random): what a `python -c` at N threads computes, without paying the interpreter's start and the imports
(torch, transformers, the C++ kernels: 3-6 s a process) for every snippet.

Protocol: tests/helpers/framed_process.py (the request a snippet str, the answer its `result`).
"""

from __future__ import annotations

import pickle
import sys

import torch

from tests.helpers.framed_process import serve


def _run(snippet: str, threads: int):
    torch.set_num_threads(threads)  # an earlier snippet may have changed it
    torch.manual_seed(0)  # nor does an earlier snippet's RNG use carry over
    namespace = {"__name__": "__thread_snippet__", "torch": torch, "pickle": pickle, "sys": sys}
    exec(compile(snippet, "<snippet>", "exec"), namespace)
    return namespace["result"]


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    serve(lambda snippet: _run(snippet, threads))


if __name__ == "__main__":
    main(int(sys.argv[1]))
