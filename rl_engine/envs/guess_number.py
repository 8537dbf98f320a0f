"""`GuessNumber`: guess a secret number with feedback turns (`rollout.env:
rl_engine.envs.guess_number:GuessNumber`; data: configs/data/guess_number.jsonl).

The secret is the record's `answer` (a whole number in [low, high]). Each model turn is a
guess, its last number: right ends the episode with reward 1.0; otherwise the observation says
"Higher." or "Lower." (or asks for a number when the turn has none), reward 0, and the model
guesses again, up to `rollout.max_turns` turns. With `algorithm.turn_reward: sum` an episode's
return is 1 when it found the number and 0 when not; `penalty` (env_args) subtracts that much
for every wrong guess, so fewer guesses score higher.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """The guessing game (module docstring); env_args: `low`, `high`, `penalty`."""

    def __init__(self, low: int = 1, high: int = 100, penalty: float = 0.0):
        if not low < high:
            raise ValueError(f"low must be below high, got low={low}, high={high}")
        self.low, self.high, self.penalty = low, high, float(penalty)
        self.secret: int | None = None

    def reset(self, record: dict) -> None:
        secret = int(str(record.get("answer")).strip())
        if not self.low <= secret <= self.high:
            raise ValueError(f"the secret {secret} is outside [{self.low}, {self.high}]")
        self.secret = secret
        return None

    def step(self, turn: dict) -> tuple[str | None, float, bool]:
        text = turn["completion"]
        if text is None:
            raise ValueError("the guessing game reads text: it needs a model with a tokenizer")
        numbers = _NUMBER.findall(text)
        if not numbers:
            return f"Reply with one number from {self.low} to {self.high}.", -self.penalty, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), -self.penalty, False
