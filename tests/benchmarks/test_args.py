"""The command line every benchmark shares (rl_engine/benchmarks/args.py): the description is the
first line of the benchmark's docstring, and `--quick` / `--tiny` are off unless given."""

from __future__ import annotations

from rl_engine.benchmarks.args import TINY_HELP, bench_parser


def test_the_parser_takes_quick_and_tiny_and_the_docstrings_first_line():
    parser = bench_parser("Decode GEMM bandwidth.\n\nMore text.", quick="fewer batches")
    assert parser.description == "Decode GEMM bandwidth."
    assert vars(parser.parse_args([])) == {"quick": False, "tiny": False}
    assert vars(parser.parse_args(["--tiny", "--quick"])) == {"quick": True, "tiny": True}
    assert (
        "fewer batches" in parser.format_help() and TINY_HELP.split(":")[0] in parser.format_help()
    )


def test_a_benchmark_without_a_docstring_has_an_empty_description():
    """`python -OO` strips docstrings: a benchmark's __doc__ is then None."""
    assert bench_parser(None, quick="q").description == ""
