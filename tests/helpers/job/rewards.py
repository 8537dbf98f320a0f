"""Rewards a test job plugs in as `rollout.task: module:function` (rl_engine/data/tasks.py)."""

from __future__ import annotations

LOW_ID = 6144  # the first eighth of SmolLM2's vocabulary


def low_ids(samples) -> list[float]:
    """The fraction of each completion's tokens below LOW_ID: varied rewards, a learning
    signal from the first step, over the arithmetic questions' chat prompts (they share the
    chat template's prefix)."""
    return [
        sum(t < LOW_ID for t in s["completion_ids"]) / max(len(s["completion_ids"]), 1)
        for s in samples
    ]
