"""Write configs/data/arithmetic_{train,val}.parquet: verl-layout addition questions.

    python scripts/make_arithmetic_data.py [--out configs/data]

Train: 512 questions "What is a plus b?" (a, b in 1..20) from seed 1. Validation: 64
distinct questions from seed 2 whose (a, b) pairs never occur in the training set: the held-out
set of configs/smollm2_arithmetic.yaml. The same command writes the same files.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

TRAIN_SEED, VAL_SEED = 1, 2
SOURCE = "arithmetic/add"


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def pairs(seed: int, count: int, exclude: set | None = None) -> list[tuple[int, int]]:
    """`count` (a, b) pairs from `seed`; with `exclude`, distinct pairs outside it."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        pair = (rng.randint(1, 20), rng.randint(1, 20))
        if exclude is None:
            out.append(pair)
        elif pair not in exclude:
            out.append(pair)
            exclude.add(pair)
    return out


def main(argv=None) -> None:
    import datasets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="configs/data")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = pairs(TRAIN_SEED, 512)
    val = pairs(VAL_SEED, 64, exclude=set(train))
    for name, items in (("train", train), ("val", val)):
        rows = [row(a, b, name, i) for i, (a, b) in enumerate(items)]
        path = out / f"arithmetic_{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
