"""Runs of the layout job on real DeepSpeed ranks, and what two runs may differ in."""

from __future__ import annotations

import torch

from tests.helpers.worker.launch import run_ranks, run_worlds

JOB = "tests.helpers.worker.layout_job"

# (ranks, ZeRO stage, trainer keys)
PACKED_ONE = (1, 0, {"micro_batch_size": 8, "packing": True})
PADDED_TWO = (2, 3, {"micro_batch_size": 2, "packing": False})
SINGLES_FOUR = (4, 1, {"micro_batch_size": 1})
BUDGET_TWO = (2, 2, {"micro_batch_size": 4, "max_tokens_per_micro_batch": 40})
LAYOUT_KEYS = {"time/"}  # metric keys allowed to differ: timings only


def layout_spec(completions, layout, dtype, *, invariant=True, steps=3, **extra) -> tuple:
    """(world size, spec) of one layout job run on the `completions` of `dtype`."""
    world, stage, trainer = layout
    spec = {
        "stage": stage,
        "dtype": dtype,
        "steps": steps,
        "completions": completions[dtype],
        "trainer": {**trainer, "layout_invariant": invariant},
        **extra,
    }
    return world, spec


def run_layout(
    tmp_path, completions, layout, dtype, *, invariant=True, steps=3, tag="", fresh=False, **extra
):
    """One run in a request of its own (a run that needs another's saved state: resume tests);
    with `fresh`, in a launch of its own (the guard that compares a shared world with one)."""
    world, spec = layout_spec(completions, layout, dtype, invariant=invariant, steps=steps, **extra)
    out = (
        tmp_path
        / f"w{world}_z{spec['stage']}_{dtype}_{invariant}_{tag}_{len(list(tmp_path.iterdir()))}"
    )
    results, error = run_ranks({"job": JOB, **spec}, world, out, timeout=600, fresh=fresh)
    assert error is None, error
    return results[0]["layout_job"]


def layout_pair(name: str, dtype: str = "bfloat16", **kwargs) -> dict:
    """{name/one: PACKED_ONE run, name/two: PADDED_TWO run} of `dtype` with `kwargs`."""
    return {
        f"{name}/one": (PACKED_ONE, dtype, kwargs),
        f"{name}/two": (PADDED_TWO, dtype, kwargs),
    }


def run_layouts(out_dir, completions, runs: dict) -> dict:
    """Rank 0's result of each named run ({name: (layout, dtype, kwargs)}); the runs of one
    world size share one request (`run_worlds`)."""
    specs = {
        name: layout_spec(completions, layout, dtype, **kwargs)
        for name, (layout, dtype, kwargs) in runs.items()
    }
    return run_worlds(JOB, specs, out_dir)


def same_state(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def same_metrics(a: list[dict], b: list[dict]) -> list[str]:
    differ = []
    for step, (row_a, row_b) in enumerate(zip(a, b, strict=True)):
        for key in sorted(row_a.keys() | row_b.keys()):
            if any(key.startswith(prefix) for prefix in LAYOUT_KEYS):
                continue
            if row_a.get(key) != row_b.get(key):
                differ.append(f"step {step + 1} {key}: {row_a.get(key)} vs {row_b.get(key)}")
    return differ
