"""Rollout files: completions from any engine as JSONL, one completion per line (docs/rollouts.md).

A line holds `prompt_token_ids`, `token_ids`, `logprobs` (one per sampled token:
`log_softmax(logits / T)` over the full vocabulary, never renormalised by
top-k/top-p), `logprob_temperature` (T, default 1.0) and optionally
`weight_version`, `reward`, `prompt_index` and `finish_reason`. Lines with the
same `prompt_index`, or else the same `prompt_token_ids`, form one GRPO group.

Reading checks every line and reports each malformed one with its 1-based line
number; `read_rollouts` computes nothing from a file that has one unless told
to skip them. Writing is atomic (rl_engine.base.io).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_engine.base.fields import is_int
from rl_engine.base.io import write_text_atomic
from rl_engine.rollout.completion import Completion

REQUIRED_FIELDS = ("prompt_token_ids", "token_ids", "logprobs")
OPTIONAL_FIELDS = (
    "logprob_temperature",
    "weight_version",
    "reward",
    "prompt_index",
    "finish_reason",
)
STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_SHOWN_BAD_LINES = 20  # an error message lists this many; RolloutFile.bad_lines has them all


@dataclass(frozen=True)
class BadLine:
    """A malformed line: where it is (1-based line number) and what is wrong with it."""

    path: str
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.problem}"


class RolloutFileError(ValueError):
    """A rollout file has malformed lines; `bad_lines` lists every one."""

    def __init__(self, bad_lines: list[BadLine]):
        self.bad_lines = bad_lines
        shown = "\n  ".join(str(b) for b in bad_lines[:_SHOWN_BAD_LINES])
        more = len(bad_lines) - _SHOWN_BAD_LINES
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(
            f"{len(bad_lines)} malformed rollout line(s) (nothing was computed; "
            f"--skip-bad-lines / skip_bad_lines=True skips them):\n  {shown}{tail}"
        )


@dataclass
class RolloutFile:
    """What a rollout file (or a folder of step files) held: its good completions and its bad lines."""

    completions: list[Completion]
    sources: list[tuple[str, int]] = field(default_factory=list)
    """(file, 1-based line) of each completion, in the same order."""
    bad_lines: list[BadLine] = field(default_factory=list)


def read_rollouts(
    path: str | Path, *, vocab_size: int | None = None, skip_bad_lines: bool = False
) -> list[Completion]:
    """The completions of a rollout file (or folder of `step_N.jsonl` files), in file order.

    `prompt_index` of each returned Completion is its GRPO group (0, 1, ... in order of
    first appearance) and `sample_index` its place in the group. Raises RolloutFileError
    listing every malformed line (ids are checked against `vocab_size` when given), unless
    `skip_bad_lines`.
    """
    parsed = parse_rollouts(path, vocab_size=vocab_size)
    if parsed.bad_lines and not skip_bad_lines:
        raise RolloutFileError(parsed.bad_lines)
    return parsed.completions


def parse_rollouts(path: str | Path, *, vocab_size: int | None = None) -> RolloutFile:
    """Every good completion and every bad line of a rollout file or folder; raises only when unreadable."""
    files = rollout_files(path)
    result = RolloutFile(completions=[])
    groups = _Groups()
    for file in files:
        with open(file, encoding="utf-8") as handle:
            for number, text in enumerate(handle, start=1):
                if not text.strip():
                    continue  # blank lines (a trailing newline, a separator) carry nothing
                try:
                    record = _parse_line(text, vocab_size)
                    completion = groups.add(record, file, number)
                except ValueError as err:
                    result.bad_lines.append(BadLine(str(file), number, str(err)))
                    continue
                result.completions.append(completion)
                result.sources.append((str(file), number))
    if not result.completions and not result.bad_lines:
        raise ValueError(f"rollout source {str(path)!r} holds no completions")
    return result


def rollout_files(path: str | Path) -> list[Path]:
    """[path] for a file; for a folder its `step_N.jsonl` files in order of N (at least one)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"rollout source {str(path)!r} does not exist")
    steps = [(int(m.group(1)), p) for p in path.iterdir() if (m := STEP_FILE.match(p.name))]
    if not steps:
        raise ValueError(f"rollout folder {str(path)!r} has no step_N.jsonl files")
    return [p for _, p in sorted(steps)]


def write_rollouts(path: str | Path, completions: Sequence[Completion]) -> Path:
    """Write completions as a rollout file (atomically); raises ValueError for a non-finite logprob."""
    lines = [json.dumps(completion_record(c), allow_nan=False) for c in completions]
    return write_text_atomic(path, "".join(line + "\n" for line in lines))


def completion_record(c: Completion) -> dict:
    """One completion as a rollout-file line (a JSON-ready dict)."""
    logprobs = torch.as_tensor(c.logprobs, dtype=torch.float32)
    if not bool(torch.isfinite(logprobs).all()):
        raise ValueError(
            f"completion of prompt {c.prompt_index} sample {c.sample_index}: logprobs must be "
            f"finite to be written, got {logprobs.tolist()}"
        )
    record = {
        "prompt_token_ids": [int(t) for t in c.prompt_ids],
        "token_ids": [int(t) for t in c.token_ids],
        "logprobs": logprobs.tolist(),  # fp32 -> Python float -> JSON -> fp32 is exact
        "logprob_temperature": float(c.logprob_temperature),
        "prompt_index": int(c.prompt_index),
        "finish_reason": c.finish_reason,
    }
    if c.weight_version is not None:
        record["weight_version"] = int(c.weight_version)
    if c.reward is not None:
        record["reward"] = float(c.reward)
    return record


# ---------------------------------------------------------------------------- one line


def _parse_line(text: str, vocab_size: int | None) -> dict:
    """The line's fields, checked; raises ValueError saying what is wrong."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"bad JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a line must be a JSON object, got {type(record).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    prompt = _token_list(record, "prompt_token_ids", vocab_size)
    tokens = _token_list(record, "token_ids", vocab_size)
    logprobs = _logprob_list(record)
    if len(logprobs) != len(tokens):
        raise ValueError(
            f"length mismatch: {len(tokens)} token_ids but {len(logprobs)} logprobs (one per token)"
        )
    return {
        "prompt": prompt,
        "tokens": tokens,
        "logprobs": logprobs,
        "temperature": _positive(record, "logprob_temperature", 1.0),
        "weight_version": _optional_index(record, "weight_version"),
        "reward": _optional_finite(record, "reward"),
        "prompt_index": _optional_index(record, "prompt_index"),
        "finish_reason": _optional_text(record, "finish_reason", "unknown"),
    }


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_list(record: dict, name: str, vocab_size: int | None) -> list[int]:
    ids = record[name]
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{name} must be a non-empty list of token ids, got {ids!r:.80}")
    for i, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"{name}[{i}] must be an int token id, got {t!r}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            valid = "" if vocab_size is None else f" (vocabulary: 0..{vocab_size - 1})"
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary{valid}")
    return ids


def _logprob_list(record: dict) -> list[float]:
    values = record["logprobs"]
    if not isinstance(values, list):
        raise ValueError(f"logprobs must be a list of numbers, got {values!r:.80}")
    for i, v in enumerate(values):
        if not _is_number(v):
            raise ValueError(f"logprobs[{i}] must be a number, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"logprobs[{i}] = {v} is not finite")
    return values


def _positive(record: dict, name: str, default: float) -> float:
    value = record.get(name, default)
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _optional_index(record: dict, name: str) -> int | None:
    value = record.get(name)
    if value is not None and (not is_int(value) or value < 0):
        raise ValueError(f"{name} must be an int >= 0 or absent, got {value!r}")
    return value


def _optional_finite(record: dict, name: str) -> float | None:
    value = record.get(name)
    if value is not None and (not _is_number(value) or not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number or absent, got {value!r}")
    return None if value is None else float(value)


def _optional_text(record: dict, name: str, default: str) -> str:
    value = record.get(name, default)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string or absent, got {value!r}")
    return value


# ---------------------------------------------------------------------------- GRPO groups


class _Groups:
    """Numbers GRPO groups in order of first appearance: by prompt_index, else by prompt_token_ids.

    A group lives in one file (a folder's step files each start their prompt_index at 0).
    """

    def __init__(self):
        self._index: dict[tuple, int] = {}
        self._sizes: list[int] = []
        self._prompts: dict[int, tuple[tuple[int, ...], str]] = {}

    def add(self, r: dict, file: Path, line: int) -> Completion:
        prompt = tuple(r["prompt"])
        # groups never span files: each step file numbers its own prompts from 0
        by_index = r["prompt_index"] is not None
        key = (str(file), "index", r["prompt_index"]) if by_index else (str(file), "ids", prompt)
        if key not in self._index:
            self._index[key] = len(self._sizes)
            self._sizes.append(0)
            self._prompts[self._index[key]] = (prompt, f"{file.name}:{line}")
        group = self._index[key]
        first_prompt, first_at = self._prompts[group]
        if prompt != first_prompt:
            raise ValueError(
                f"prompt_index {r['prompt_index']} has different prompt_token_ids than at "
                f"{first_at}: one GRPO group is one prompt"
            )
        sample = self._sizes[group]
        self._sizes[group] += 1
        return Completion(
            prompt_ids=list(r["prompt"]),
            token_ids=list(r["tokens"]),
            logprobs=torch.tensor(r["logprobs"], dtype=torch.float32),
            finish_reason=r["finish_reason"],
            weight_version=r["weight_version"],
            prompt_index=group,
            sample_index=sample,
            logprob_temperature=r["temperature"],
            reward=r["reward"],
        )
