"""Config field checks: one wording, '<key> must be <requirement>, got <value>', and no bool
passing for an int or a number."""

import math
import re

import pytest

from rl_engine.base.fields import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_text,
    is_int,
)


def test_is_int_refuses_bools():
    assert is_int(3) and not is_int(True) and not is_int(3.0)


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (
            lambda v: check_int("trainer.epochs", v, 1),
            0,
            "trainer.epochs must be an int >= 1, got 0",
        ),
        (lambda v: check_int("trainer.epochs", v, 1), True, "got True"),
        (lambda v: check_number("trainer.lr", v, low=0, low_open=True), 0, "a finite number > 0"),
        (lambda v: check_number("trainer.lr", v, low=0), math.nan, "got nan"),
        (lambda v: check_number("x.p", v, low=0, high=1), 1.5, "a finite number >= 0 and <= 1"),
        (lambda v: check_choice("parity", v, ("strict", "off")), "on", "one of ['strict', 'off']"),
        (lambda v: check_choice("x.n", v, (1, 2)), 1.0, "got 1.0"),
        (lambda v: check_bool("trainer.packing", v), 1, "trainer.packing must be true or false"),
        (lambda v: check_text("model", v), "", "model must be a non-empty string"),
    ],
)
def test_a_bad_value_names_the_key_the_rule_and_the_value(check, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check(value)


@pytest.mark.parametrize(
    "check",
    [
        lambda: check_int("k", 1, 1),
        lambda: check_number("k", 0.5, low=0, high=1),
        lambda: check_number("k", 1, low=0, high=1),
        lambda: check_choice("k", "strict", ("strict", "off")),
        lambda: check_bool("k", False),
        lambda: check_text("k", "tiny-llama"),
    ],
)
def test_a_good_value_passes(check):
    assert check() is None
