"""The command line every benchmark shares: `--quick` and `--tiny`.

`--quick`: fewer shapes or repetitions, the same sizes. `--tiny`: a smoke run (tiny random
model and shapes, one repetition, seconds on any CPU): its figures mean nothing, its table
has the rows and columns of the full run. `rl-engine bench` passes both on; the smoke tests
(tests/benchmarks/) run every benchmark with `--tiny`.
"""

from __future__ import annotations

import argparse

TINY_HELP = "smoke run: tiny random model and shapes, one repetition (the figures mean nothing)"


def bench_parser(doc: str | None, *, quick: str) -> argparse.ArgumentParser:
    """A benchmark's parser: the first line of its docstring, `--quick` (what `quick` says) and `--tiny`."""
    first_line = next(iter((doc or "").strip().splitlines()), "")  # None under python -OO
    parser = argparse.ArgumentParser(description=first_line)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--tiny", action="store_true", help=TINY_HELP)
    return parser
