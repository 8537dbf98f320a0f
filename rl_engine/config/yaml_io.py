"""The run config as text: reading YAML, `--set key=value` overrides, unknown keys, writing YAML.

Nothing here knows a section's fields: RunConfig (run.py) hands its classes in, so a new
section or key needs no change here.
"""

from __future__ import annotations

import copy
import re
from dataclasses import fields
from pathlib import Path

import yaml

from rl_engine.base.fields import fail
from rl_engine.base.io import write_text_atomic


def read_yaml(path: str | Path):
    """The YAML document in `path`; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {str(path)!r} does not exist") from None
    try:
        return yaml.load(text, Loader=_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: YAML syntax error: {problem}") from None


def write_yaml(path: str | Path, data: dict) -> None:
    """Write `data` as YAML, atomically (a run directory's snapshot is never half-written)."""
    write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` with each 'dotted.key=value' set; values are parsed as YAML ('1e-5' -> 1e-05)."""
    if not isinstance(data, dict):
        fail("config", "a mapping", data)
    data = copy.deepcopy(data)
    for item in overrides:
        _apply_override(data, item)
    return data


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(
            f"--set {item!r}: expected key=value with a dotted key, e.g. trainer.lr=1e-5"
        )
    try:
        value = yaml.load(raw, Loader=_loader())
    except yaml.YAMLError as err:
        raise ValueError(f"--set {item!r}: the value is not valid YAML ({err.problem})") from None
    *sections, leaf = key.split(".")
    node = data
    for depth, name in enumerate(sections):
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            where = ".".join(sections[: depth + 1])
            raise ValueError(f"--set {item!r}: {where} is not a section")
    node[leaf] = value


def check_keys(data, top_cls: type, sections: dict[str, type]) -> None:
    """`data` is a mapping whose sections are mappings, with no key that a class lacks; unknown
    keys are listed together, each with its section and the valid keys."""
    if not isinstance(data, dict):
        fail("config", "a mapping", data)
    for name in sections:
        if not isinstance(data.get(name, {}), dict):
            fail(name, "a mapping", data[name])
    unknown = _unknown_keys(top_cls, data, "")
    for name, section_cls in sections.items():
        unknown += _unknown_keys(section_cls, data.get(name, {}), f"{name}.")
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(unknown)}")


def _unknown_keys(cls: type, data: dict, prefix: str) -> list[str]:
    """'section.key (valid: ...)' for every key of `data` that `cls` has no field for."""
    known = sorted(f.name for f in fields(cls))
    return [f"{prefix}{key} (valid: {', '.join(known)})" for key in data if key not in known]


def _loader():
    """SafeLoader that also reads '1e-5' as a float (YAML 1.1 wants '1.0e-5'; users write both)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
            r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"
        ),
        list("-+0123456789."),
    )
    return Loader
