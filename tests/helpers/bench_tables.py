"""Reading what a benchmark prints: its markdown tables as rows of {column header: cell}, the
figures in them checked finite (times and memory >= 0, ratios > 0), and `rl-engine bench ...
--tiny` run in-process (tests/benchmarks/)."""

from __future__ import annotations

import math
import re

from rl_engine import cli

DTYPES = {"float32", "bfloat16"}
_SEPARATOR = re.compile(r"\|(\s*:?-+:?\s*\|)+")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text`, in order: its rows as {column header: cell}."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and _SEPARATOR.fullmatch(lines[i + 1].strip()):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]), strict=True)))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def number(cell: str) -> float:
    """A figure of a table cell ('12.3', '0.84x')."""
    value = float(cell.removesuffix("x"))
    assert math.isfinite(value), cell
    return value


def assert_figures(rows: list[dict[str, str]], times=(), ratios=(), memory=()) -> None:
    """Times and memory finite and >= 0, ratios finite and > 0, in every row."""
    assert rows
    for row in rows:
        for column in (*times, *memory):
            assert number(row[column]) >= 0, (column, row)
        for column in ratios:
            assert number(row[column]) > 0, (column, row)


def bench(capsys, *argv: str) -> list[list[dict[str, str]]]:
    """Run `rl-engine bench ... --tiny`; the tables it printed."""
    assert cli.main(["bench", *argv, "--tiny"]) == 0
    return tables(capsys.readouterr().out)


def bench_modules(
    what: str, case: str | None = None, *, device: str = "cpu", engine: str = "own"
) -> tuple[str, ...]:
    """The modules of rl_engine/benchmarks/ that `rl-engine bench WHAT [--case CASE]` runs."""
    return cli._bench_table(device, engine)[what][case]
