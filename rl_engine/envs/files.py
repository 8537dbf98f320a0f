"""Multi-turn episodes in rollout files: a line may carry `policy_mask` (docs/rollouts.md).

A multi-turn line is a rollout-file line (rl_engine.rollout.files) whose `token_ids` hold
everything after the prompt, the model's turns and the environment's observations in order,
with `policy_mask`: one 0 / 1 (or false / true) per entry of `token_ids`, 1 where the policy
sampled the token. `logprobs` still has one number per token; the entries under a 0 are
ignored (rl_engine writes 0.0 there). At least one token must be the policy's.

rollout/files.py reads and writes the single-turn fields (and ignores other keys); this module
adds the mask on top: `parse_episode_rollouts` is `parse_rollouts` whose lines with a mask come
back as `Episode`s, and a malformed mask is a bad line like any other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from rl_engine.envs.episode import Episode
from rl_engine.base.io import write_text_atomic
from rl_engine.rollout.files import BadLine, RolloutFile, completion_record, parse_rollouts

MASK_FIELD = "policy_mask"


def episode_record(c) -> dict:
    """One completion as a rollout-file line; an episode's with its policy_mask."""
    record = completion_record(c)
    mask = getattr(c, MASK_FIELD, None)
    if mask is not None:
        record[MASK_FIELD] = [int(bool(m)) for m in mask]
    return record


def write_episodes(path: str | Path, completions: Sequence) -> Path:
    """Completions and episodes as a rollout file (atomically)."""
    lines = [json.dumps(episode_record(c), allow_nan=False) for c in completions]
    return write_text_atomic(path, "".join(line + "\n" for line in lines))


def parse_episode_rollouts(path: str | Path, *, vocab_size: int | None = None) -> RolloutFile:
    """`parse_rollouts(path)` with each line's `policy_mask` read: those lines as Episodes,
    a malformed mask a bad line (the others stay Completions)."""
    parsed = parse_rollouts(path, vocab_size=vocab_size)
    texts = _line_texts({file for file, _ in parsed.sources})
    out = RolloutFile(completions=[], bad_lines=list(parsed.bad_lines))
    for c, (file, line) in zip(parsed.completions, parsed.sources):
        raw = json.loads(texts[file][line]).get(MASK_FIELD)
        if raw is None:
            out.completions.append(c)
            out.sources.append((file, line))
            continue
        try:
            mask = _mask(raw, len(c.token_ids))
        except ValueError as err:
            out.bad_lines.append(BadLine(file, line, str(err)))
            continue
        values = {f.name: getattr(c, f.name) for f in fields(c)}
        out.completions.append(Episode(**values, policy_mask=mask))
        out.sources.append((file, line))
    return out


def _line_texts(files: set[str]) -> dict[str, dict[int, str]]:
    """Each file's lines by 1-based number, split as parse_rollouts splits them."""
    texts = {}
    for file in files:
        with open(file, encoding="utf-8") as handle:
            texts[file] = dict(enumerate(handle, start=1))
    return texts


def _mask(raw, length: int) -> list[bool]:
    if not isinstance(raw, list) or any(m not in (0, 1) or isinstance(m, float) for m in raw):
        raise ValueError(f"{MASK_FIELD} must be a list of 0 / 1 (or booleans), got {raw!r:.80}")
    if len(raw) != length:
        raise ValueError(
            f"length mismatch: {length} token_ids but {len(raw)} {MASK_FIELD} entries (one per token)"
        )
    if not any(raw):
        raise ValueError(f"{MASK_FIELD} marks no token as the policy's: nothing to score")
    return [bool(m) for m in raw]
