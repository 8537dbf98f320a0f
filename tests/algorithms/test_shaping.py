"""DAPO's soft overlong penalty (rl_engine/algorithms/shaping.py): 0 up to max_length - buffer
tokens, then linear down to -factor over the buffer, -factor at and beyond the limit; the
arguments' errors name the argument."""

from __future__ import annotations

import pytest
import torch

from rl_engine.algorithms import overlong_penalty


def test_overlong_penalty_hand_computed():
    # L = 20, buffer 4: no penalty up to 16 tokens, then -factor * (|y| - 16) / 4, -factor at 20.
    lengths = torch.tensor([10, 16, 17, 18, 20])
    penalty = overlong_penalty(lengths, max_length=20, buffer=4, factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    half = overlong_penalty(lengths, max_length=20, buffer=4, factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ValueError, match="buffer must be"):
        overlong_penalty(lengths, max_length=20, buffer=21, factor=1.0)


def test_beyond_the_limit_the_penalty_stays_at_minus_factor_and_factor_zero_is_off():
    lengths = torch.tensor([0, 21, 100], dtype=torch.int64)
    assert overlong_penalty(lengths, max_length=20, buffer=4, factor=2.0).tolist() == [
        0.0,
        -2.0,
        -2.0,
    ]
    assert overlong_penalty(lengths, max_length=20, buffer=20, factor=0.0).abs().sum().item() == 0.0
    whole = overlong_penalty(torch.tensor([0, 10, 20]), max_length=20, buffer=20, factor=1.0)
    assert whole.tolist() == [0.0, -0.5, -1.0] and whole.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0}, "max_length must be an int >= 1, got 0"),
        ({"max_length": True}, "max_length must be an int >= 1, got True"),
        ({"buffer": 0}, r"buffer must be an int in \[1, max_length = 20\], got 0"),
        ({"factor": -1.0}, "factor must be >= 0, got -1.0"),
        ({"factor": float("nan")}, "factor must be >= 0, got nan"),
        ({"lengths": torch.ones(2, 2)}, r"lengths must be a 1-D \(B,\) tensor"),
        ({"lengths": [1, 2]}, r"lengths must be a 1-D \(B,\) tensor"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, message):
    args = {"lengths": torch.tensor([1, 2]), "max_length": 20, "buffer": 4, "factor": 1.0, **kwargs}
    lengths = args.pop("lengths")
    with pytest.raises(ValueError, match=message):
        overlong_penalty(lengths, **args)
