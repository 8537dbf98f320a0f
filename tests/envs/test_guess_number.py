"""The guessing game (rl_engine/envs/guess_number.py): higher / lower feedback, less the
penalty, until the secret (the record's answer); the secret and the range are checked, and a turn
without text is refused by name."""

from __future__ import annotations

import pytest

from rl_engine.envs import load_environment
from rl_engine.envs.guess_number import GuessNumber


def test_guess_number_says_higher_or_lower():
    env = GuessNumber(penalty=0.1)
    env.reset({"answer": "42"})
    assert env.step({"completion": "50"}) == ("Lower.", -0.1, False)
    assert env.step({"completion": "maybe 10, no: 30"}) == ("Higher.", -0.1, False)
    assert env.step({"completion": "no idea"}) == (
        "Reply with one number from 1 to 100.",
        -0.1,
        False,
    )
    assert env.step({"completion": "42"}) == (None, 1.0, True)
    with pytest.raises(ValueError, match="outside"):
        GuessNumber().reset({"answer": "101"})
    with pytest.raises(ValueError, match="low must be below high"):
        GuessNumber(low=5, high=5)


def test_the_last_number_of_a_turn_is_the_guess_in_any_range():
    env = load_environment("rl_engine.envs.guess_number:GuessNumber")(low=-5, high=5)
    env.reset({"answer": " -3 "})
    assert env.step({"completion": "-3? no, 4"}) == ("Lower.", -0.0, False)
    assert env.step({"completion": "nothing"}) == (
        "Reply with one number from -5 to 5.",
        -0.0,
        False,
    )
    assert env.step({"completion": "then -3"}) == (None, 1.0, True)


def test_a_bad_secret_or_a_turn_without_text_is_refused_by_name():
    with pytest.raises(ValueError, match=r"the secret 0 is outside \[1, 100\]"):
        GuessNumber().reset({"answer": "0"})
    with pytest.raises(ValueError, match="low must be below high, got low=7, high=3"):
        GuessNumber(low=7, high=3)
    env = GuessNumber()
    env.reset({"answer": "5"})
    with pytest.raises(ValueError, match="guessing game reads text"):
        env.step({"completion_ids": [5], "completion": None})
