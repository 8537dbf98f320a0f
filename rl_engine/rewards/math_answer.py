"""Built-in reward `math`: the completion's answer equals the ground truth by math-verify.

math-verify parses both sides (\\boxed{...} first, then LaTeX, then plain expressions and
numbers) and compares them symbolically: `\\frac{1}{2}`, `0.5` and `1/2` are one answer.
Its own signal-based timeouts are off (`parsing_timeout=None`): the caller's time limit
(`reward.timeout_s`) covers the whole call.
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
    """1.0 when math-verify finds `ground_truth` in `solution_str`, else 0.0."""
    from math_verify import parse, verify

    truth = str(ground_truth).strip()
    gold = parse(
        truth if ("\\boxed" in truth or "$" in truth) else f"${truth}$", parsing_timeout=None
    )
    if not gold:
        gold = parse(truth, parsing_timeout=None)
    answer = parse(solution_str, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
