"""Write the shipped environments' data files (verl layout, JSON lines) into configs/data/.

    python scripts/make_env_data.py [--out configs/data]

- calculator_train.jsonl (256 rows, seed 1) and calculator_val.jsonl (64 rows, seed 2, no
  question of training): "What is a OP b?" with two- and three-digit operands and OP one of
  + - *, the answer the exact result; for rl_engine.envs.calculator:Calculator (and the same
  questions answer without a tool under a plain reward: configs/data/arithmetic_reward.py).
- guess_number.jsonl (100 rows, seed 3): one prompt per secret 1..100 in a shuffled order,
  the secret as the answer; for rl_engine.envs.guess_number:GuessNumber.

The same command writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
GUESS_PROMPT = (
    "I am thinking of a whole number from 1 to 100. Guess it: reply with one number. "
    "After each wrong guess I will tell you whether my number is higher or lower."
)


def question(rng: random.Random) -> tuple[int, str, int]:
    op = rng.choice(sorted(OPERATIONS))
    high = 999 if op == "+" else 99
    return rng.randint(10, high), op, rng.randint(10, high)


def calculator_row(a: int, op: str, b: int, split: str, index: int) -> dict:
    return {
        "data_source": "calculator/arithmetic",
        "prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(OPERATIONS[op](a, b))},
        "extra_info": {"split": split, "index": index, "expression": f"{a} {op} {b}"},
    }


def guess_row(secret: int, index: int) -> dict:
    return {
        "data_source": "guess_number",
        "prompt": [{"role": "user", "content": GUESS_PROMPT}],
        "reward_model": {"style": "rule", "ground_truth": str(secret)},
        "extra_info": {"index": index},
    }


def questions(seed: int, count: int, exclude: set) -> list[tuple[int, str, int]]:
    rng, out = random.Random(seed), []
    while len(out) < count:
        q = question(rng)
        if q not in exclude:
            exclude.add(q)
            out.append(q)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} rows")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="configs/data")
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    val = questions(2, 64, set())
    train = questions(1, 256, set(val))
    for name, items in (("train", train), ("val", val)):
        rows = [calculator_row(a, op, b, name, i) for i, (a, op, b) in enumerate(items)]
        write_jsonl(out / f"calculator_{name}.jsonl", rows)
    secrets = list(range(1, 101))
    random.Random(3).shuffle(secrets)
    write_jsonl(out / "guess_number.jsonl", [guess_row(s, i) for i, s in enumerate(secrets)])


if __name__ == "__main__":
    main()
