"""The built-in `math` reward (rl_engine/rewards/math_answer.py, math-verify): boxed LaTeX,
plain numbers and fractions verified against the ground truth, 1.0 or 0.0."""

from __future__ import annotations

import pytest

from rl_engine.rewards import load_reward_function
from rl_engine.rewards.math_answer import compute_score


@pytest.mark.parametrize(
    ("solution", "truth", "score"),
    [
        ("7 + 5 = 12", "12", 1.0),
        ("The answer is \\boxed{12}.", "12", 1.0),
        ("The answer is \\boxed{13}.", "12", 0.0),
        ("so x = \\frac{1}{2}", "0.5", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("no idea", "3", 0.0),
    ],
)
def test_builtin_math_verifies_boxed_latex_and_numbers(solution, truth, score):
    assert load_reward_function("math")("lighteval/MATH", solution, truth) == score


def test_the_module_is_what_the_math_builtin_loads():
    assert load_reward_function("math") is compute_score
    assert compute_score("lighteval/MATH", "\\boxed{4}", "4") == 1.0
    assert compute_score("lighteval/MATH", "\\boxed{5}", "4") == 0.0
