"""Datasets on disk as verl's preprocessing writes them."""

from __future__ import annotations


def verl_rows(count: int, source: str = "toy/add") -> list[dict]:
    """Rows as verl's preprocessing scripts write them (gsm8k.py, math_dataset.py)."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"what is {i} plus {i + 1} ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)
