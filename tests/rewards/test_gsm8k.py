"""The built-in `gsm8k` reward (rl_engine/rewards/gsm8k.py): verl's '#### answer' convention,
strict (after '####' only) or flexible (the last number), commas and dollars cleaned, a
whole reference solution as the ground truth, and the format score for a wrong answer in form."""

from __future__ import annotations

import pytest

from rl_engine.rewards import load_reward_function
from rl_engine.rewards.gsm8k import compute_score, extract_answer


def test_builtin_gsm8k_uses_the_hash_convention():
    fn = load_reward_function("gsm8k")
    assert fn("openai/gsm8k", "3 + 4 = 7 #### 7", "7") == 1.0
    assert fn("openai/gsm8k", "so #### 1,000", "Janet ... #### 1000") == 1.0  # a whole solution
    assert fn("openai/gsm8k", "the answer is 7", "7") == 0.0  # strict: no '####'
    assert fn("openai/gsm8k", "the answer is 7", "7", method="flexible") == 1.0
    assert fn("openai/gsm8k", "#### 8", "7", format_score=0.1) == 0.1
    auto = load_reward_function(None)  # by data_source, as verl's default_compute_score
    assert auto("openai/gsm8k", "7", "7") == 0.0 and auto("lighteval/MATH", "7", "7") == 1.0


@pytest.mark.parametrize(
    ("text", "method", "answer"),
    [
        ("so #### 1,234.", "strict", "1234"),
        ("#### $5 and then #### 6", "strict", "6"),
        ("the answer is 7", "strict", None),
        ("it costs $1,000. Or 12.5?", "flexible", "12.5"),
        ("no number here.", "flexible", None),
        ("-3 degrees", "flexible", "-3"),
    ],
)
def test_extract_answer_takes_the_last_answer_in_the_form(text, method, answer):
    assert extract_answer(text, method) == answer


def test_an_unknown_method_names_itself():
    with pytest.raises(ValueError, match="method must be 'strict' or 'flexible', got 'loose'"):
        extract_answer("#### 1", "loose")


def test_numbers_compare_as_numbers_and_the_score_is_configurable():
    assert compute_score("gsm8k", "#### 7.0", "7") == 1.0
    assert compute_score("gsm8k", "#### 7", "7", score=2.0) == 2.0
    assert compute_score("gsm8k", "nothing", "7", format_score=0.1) == 0.0  # no answer: no format
