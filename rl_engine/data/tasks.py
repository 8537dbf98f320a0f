"""Prompt sources and verifiable rewards for RL jobs (`rollout.task`).

- `count` needs no tokenizer (tiny random models): prompts are random token ids and
  the reward is the fraction of completion tokens inside a band of ids, a task a
  policy gradient learns in a few steps.
- `arithmetic` needs a tokenizer (SmolLM2): "What is a plus b?", reward 1.0 when the
  completion's final answer is a+b (`answer_matches`).
- `jsonl:PATH`: prompts from a file, one `{"prompt": str, "answer": str}` per line,
  rewarded by the same rule as `arithmetic`.
- `module:function` (or `path/to/file.py:function`, loaded as `reward.function` is): the
  user's reward, `fn(samples) -> list[float]`, over the built-in prompts (arithmetic questions with a tokenizer, random token prompts without); each
  sample is a dict with `prompt_ids`, `completion_ids`, `prompt` and `completion` (text,
  or None without a tokenizer) and `answer` (or None).

Prompts of step s are a function of (seed, s) only, so a resumed run sees the same
prompts as an uninterrupted one: the step is the whole task state.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rl_engine.rewards import load_function

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The completion's final answer: its last number (text without one: its last word)."""
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    words = text.split()
    return words[-1].strip(".,;:!?\"'") if words else ""


def answer_matches(text: str, answer: str) -> bool:
    """The reward rule of `arithmetic` and `jsonl:` tasks.

    A numeric answer must be the completion's last number; any other answer must end the
    completion (as whole words, ignoring trailing punctuation).
    """
    answer = str(answer).strip()
    if _NUMBER.fullmatch(answer):
        return final_answer(text) == answer
    tail = text.rstrip().rstrip(".,;:!?\"'")
    return bool(answer) and re.search(rf"(?:^|\W){re.escape(answer)}$", tail) is not None


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


class _QuestionTask:
    """Chat prompts of `questions(count, step)`; reward 1.0 when a completion's final answer matches."""

    def prompts(self, count, step):
        return [_chat_prompt(self.tokenizer, q) for q, _ in self.questions(count, step)]

    def answers(self, count, step) -> list[str]:
        return [answer for _, answer in self.questions(count, step)]

    def rewards(self, prompt_indices, completions, step):
        answers = self.answers(max(prompt_indices) + 1, step)
        return [
            1.0 if answer_matches(_decode(self.tokenizer, tokens), answers[idx]) else 0.0
            for idx, tokens in zip(prompt_indices, completions)
        ]


@dataclass
class ArithmeticTask(_QuestionTask):
    """'What is a plus b?' as a chat prompt; reward 1.0 when the completion's final answer is a+b."""

    tokenizer: object
    seed: int = 0
    name: str = "arithmetic"

    def _operands(self, count, step):
        rng = random.Random(self.seed * 1_000_003 + step)
        return [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(count)]

    def questions(self, count, step) -> list[tuple[str, str]]:
        """(question text, answer) pairs of this step."""
        return [
            (f"What is {a} plus {b}? Answer with just the number.", str(a + b))
            for a, b in self._operands(count, step)
        ]


@dataclass
class JsonlTask(_QuestionTask):
    """Prompts drawn from a JSONL file (`jsonl:PATH`), rewarded like `arithmetic`."""

    records: list[tuple[str, str]]
    tokenizer: object
    seed: int = 0
    name: str = "jsonl"

    def questions(self, count, step) -> list[tuple[str, str]]:
        rng = random.Random(self.seed * 1_000_003 + step)
        if count <= len(self.records):
            return rng.sample(self.records, count)
        return [rng.choice(self.records) for _ in range(count)]


@dataclass
class FunctionTask:
    """The user's reward `fn(samples) -> list[float]` over a built-in task's prompts."""

    prompts_from: Task
    reward_fn: Callable
    spec: str
    tokenizer: object = None
    name: str = field(default="function")

    def prompts(self, count, step):
        return self.prompts_from.prompts(count, step)

    def rewards(self, prompt_indices, completions, step):
        count = max(prompt_indices) + 1
        prompts = self.prompts(count, step)
        answers = getattr(self.prompts_from, "answers", lambda c, s: [None] * c)(count, step)
        samples = [
            {
                "prompt_ids": list(prompts[idx]),
                "completion_ids": list(tokens),
                "prompt": _decode(self.tokenizer, prompts[idx]),
                "completion": _decode(self.tokenizer, tokens),
                "answer": answers[idx],
            }
            for idx, tokens in zip(prompt_indices, completions)
        ]
        rewards = self.reward_fn(samples)
        return _checked_rewards(self.spec, rewards, len(samples))


TASKS = ("count", "arithmetic", "module:function", "jsonl:PATH")


def make_task(name: str, *, vocab_size: int, tokenizer=None, seed: int = 0) -> Task:
    """The task `rollout.task` names; errors name the key and what is wrong."""
    if name.startswith("jsonl:"):
        return JsonlTask(
            read_prompt_file(name[len("jsonl:") :]), _need_tokenizer(name, tokenizer), seed
        )
    if ":" in name:
        builtin = "arithmetic" if tokenizer is not None else "count"
        prompts = make_task(builtin, vocab_size=vocab_size, tokenizer=tokenizer, seed=seed)
        return FunctionTask(prompts, load_task_function(name), name, tokenizer)
    if name == "count":
        return CountTask(vocab_size=vocab_size, seed=seed)
    if name == "arithmetic":
        return ArithmeticTask(tokenizer=_need_tokenizer(name, tokenizer), seed=seed)
    raise ValueError(f"unknown rollout.task {name!r}; available tasks: {', '.join(TASKS)}")


def check_task_spec(name: str) -> None:
    """Everything about `rollout.task` that can be checked without a model (before Ray starts)."""
    if name.startswith("jsonl:"):
        read_prompt_file(name[len("jsonl:") :])
    elif ":" in name:
        load_task_function(name)
    elif name not in ("count", "arithmetic"):
        raise ValueError(f"unknown rollout.task {name!r}; available tasks: {', '.join(TASKS)}")


def load_task_function(spec: str) -> Callable:
    """`module:function` or `path/to/file.py:function` -> the user's reward `fn(samples)`; loaded
    as `reward.function` is (rl_engine.rewards.load_function), the error says which part failed."""
    return load_function(spec, "rollout.task", forms="module:function or path/to/file.py:function")


def read_prompt_file(path: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a JSONL prompt file; a bad line is named by file and line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"rollout.task 'jsonl:{path}': file {str(file)!r} does not exist")
    records = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}:{number}: not valid JSON ({err.msg})") from None
        if not (
            isinstance(record, dict)
            and isinstance(record.get("prompt"), str)
            and isinstance(record.get("answer"), str)
        ):
            raise ValueError(
                f'{file}:{number}: expected {{"prompt": str, "answer": str}}, got {line.strip()[:80]}'
            )
        records.append((record["prompt"], record["answer"]))
    if not records:
        raise ValueError(f"rollout.task 'jsonl:{path}': {str(file)!r} holds no prompts")
    return records


def _need_tokenizer(name: str, tokenizer):
    if tokenizer is None:
        raise ValueError(
            f"rollout.task {name!r} needs a model with a tokenizer (e.g. smollm2-135m-instruct)"
        )
    return tokenizer


def _chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a user turn (chat template when the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)
    return list(tokenizer.encode(text))


def _decode(tokenizer, tokens) -> str | None:
    return None if tokenizer is None else tokenizer.decode(list(tokens), skip_special_tokens=True)


def _checked_rewards(spec: str, rewards, expected: int) -> list[float]:
    ok = isinstance(rewards, (list, tuple)) and len(rewards) == expected
    if not ok or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
        raise ValueError(
            f"rollout.task {spec!r} must return a list of {expected} numbers, got {rewards!r:.200}"
        )
    return [float(r) for r in rewards]
