"""Prompt sources and verifiable rewards for RL jobs.

`count` needs no tokenizer (tiny random models): prompts are random token ids and
the reward is the fraction of completion tokens inside a band of ids, a task a
policy gradient learns in a few steps. `arithmetic` needs a tokenizer
(SmolLM2): "What is a plus b?" with reward 1 when the completion contains a+b.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Protocol


class Task(Protocol):
    name: str

    def prompts(self, count: int, step: int) -> list[list[int]]: ...

    def rewards(
        self, prompt_indices: list[int], completions: list[list[int]], step: int
    ) -> list[float]: ...


@dataclass
class CountTask:
    """Reward = fraction of generated tokens whose id lies in the target band [0, vocab/8).

    A random policy scores about 1/8, so every GRPO group has signal from the first step.
    """

    vocab_size: int
    band_fraction: float = 0.125
    prompt_len: int = 8
    seed: int = 0
    name: str = "count"

    def prompts(self, count: int, step: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + step)
        return [
            [rng.randrange(3, self.vocab_size) for _ in range(self.prompt_len)]
            for _ in range(count)
        ]

    def rewards(self, prompt_indices, completions, step):
        band = int(self.vocab_size * self.band_fraction)
        return [sum(t < band for t in c) / max(len(c), 1) for c in completions]


@dataclass
class ArithmeticTask:
    """'What is a plus b?' as a chat prompt; reward 1.0 when the answer appears in the completion."""

    tokenizer: object
    seed: int = 0
    name: str = "arithmetic"

    def _operands(self, count, step):
        rng = random.Random(self.seed * 1_000_003 + step)
        return [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(count)]

    def prompts(self, count, step):
        out = []
        for a, b in self._operands(count, step):
            chat = [
                {"role": "user", "content": f"What is {a} plus {b}? Answer with just the number."}
            ]
            out.append(
                self.tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return [list(p) for p in out]

    def rewards(self, prompt_indices, completions, step):
        operands = self._operands(max(prompt_indices) + 1, step)
        scores = []
        for idx, tokens in zip(prompt_indices, completions):
            a, b = operands[idx]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            scores.append(1.0 if re.search(rf"\b{a + b}\b", text) else 0.0)
        return scores


TASKS = ("count", "arithmetic")


def make_task(name: str, *, vocab_size: int, tokenizer=None, seed: int = 0) -> Task:
    if name == "count":
        return CountTask(vocab_size=vocab_size, seed=seed)
    if name == "arithmetic":
        if tokenizer is None:
            raise ValueError(
                "rollout.task 'arithmetic' needs a model with a tokenizer (e.g. smollm2-135m-instruct)"
            )
        return ArithmeticTask(tokenizer=tokenizer, seed=seed)
    raise ValueError(f"unknown rollout.task {name!r}; available tasks: {', '.join(TASKS)}")
