"""Built-in reward `gsm8k`: GSM8K's `#### answer` convention, as verl's gsm8k reward scores it.

The completion's answer is the number after its last `#### ` ('strict', the default), or
its last number ('flexible'). The ground truth may be the bare number or a whole GSM8K
solution ending in `#### 72`. Numbers compare by value after removing `,` and `$`
(`1,000` == `1000`, `72.0` == `72`).
"""

from __future__ import annotations

import re
from typing import Any

_STRICT = re.compile(r"#### (\-?[0-9\.\,\$]+)")
_NUMBER = re.compile(r"-?[0-9][0-9\,]*\.?[0-9]*|-?\.[0-9]+")


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The answer a completion gives (None: none in the expected form)."""
    if method == "strict":
        found = _STRICT.findall(text)
        return _clean(found[-1]) if found else None
    if method == "flexible":
        found = [n for n in _NUMBER.findall(text) if _clean(n) not in ("", ".")]
        return _clean(found[-1]) if found else None
    raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info=None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` for the right answer, `format_score` for a wrong one in the right form, else 0."""
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.split("####")[-1]
    truth = _clean(truth.strip())
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same(answer, truth) else format_score
