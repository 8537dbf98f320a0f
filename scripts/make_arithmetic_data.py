"""Write configs/data/arithmetic_{train,val}.parquet: verl-layout addition questions.

    python scripts/make_arithmetic_data.py [--out configs/data]

Validation: 64 distinct questions "What is a plus b?" (a, b in 1..10) from seed 2, the
held-out set of configs/smollm2_arithmetic.yaml. Train: 512 questions from seed 1 over
the other pairs (no validation pair occurs in training). The same command writes the
same files.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

TRAIN_SEED, VAL_SEED = 1, 2
HIGH = 10  # operands 1..HIGH
SOURCE = "arithmetic/add"


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def pairs(seed: int, count: int, exclude: set, distinct: bool) -> list[tuple[int, int]]:
    """`count` (a, b) pairs from `seed` outside `exclude` (`distinct`: no repeats)."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        pair = (rng.randint(1, HIGH), rng.randint(1, HIGH))
        if pair not in exclude:
            out.append(pair)
            if distinct:
                exclude.add(pair)
    return out


def main(argv=None) -> None:
    import datasets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="configs/data")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    val = pairs(VAL_SEED, 64, set(), distinct=True)
    train = pairs(TRAIN_SEED, 512, set(val), distinct=False)
    for name, items in (("train", train), ("val", val)):
        rows = [row(a, b, name, i) for i, (a, b) in enumerate(items)]
        path = out / f"arithmetic_{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
