"""PPO's critic under trainer.layout_invariant on real DeepSpeed ranks (gloo): critic runs that
differ only in layout keys (critic.num_ranks, critic.zero_stage, micro-batch size, packing)
score the same values for GAE, end every step with the same weights and AdamW moments, bit
for bit, and report the same critic/* metrics; a critic state saved on one layout resumes on
another and continues exactly. Negative control: the same layouts with the flag off differ.
The layout pair and its control share one request per world size (the `runs` fixture).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.worker.cell import cached_completions
from tests.helpers.worker.launch import run_ranks, run_worlds, selected_runs

JOB = "tests.helpers.worker.critic_layout_job"
# (critic ranks, critic ZeRO stage, trainer keys: the critic's micro-batching is the trainer's)
PACKED_ONE = (1, 0, {"micro_batch_size": 8, "packing": True})
PADDED_TWO = (2, 3, {"micro_batch_size": 2, "packing": False})


@pytest.fixture(scope="module")
def completions(tmp_path_factory):
    path = tmp_path_factory.mktemp("completions") / "bfloat16.pt"
    torch.save(cached_completions("bfloat16"), path)
    return str(path)


def _spec(completions, layout, *, invariant=True, steps=3, **extra) -> tuple[int, dict]:
    world, stage, trainer = layout
    spec = {
        "dtype": "bfloat16",
        "model": "tiny-qwen3",
        "steps": steps,
        "completions": completions,
        "critic": {"num_ranks": world, "zero_stage": stage, "lr": 1e-2},
        "trainer": {**trainer, "layout_invariant": invariant},
        **extra,
    }
    return world, spec


def _run(tmp_path, completions, layout, *, invariant=True, steps=3, tag="", **extra) -> dict:
    """One run in a request of its own (the resume tests: a run restores another's saved state)."""
    world, spec = _spec(completions, layout, invariant=invariant, steps=steps, **extra)
    out = tmp_path / f"w{world}_z{layout[1]}_{invariant}_{tag}_{len(list(tmp_path.iterdir()))}"
    results, error = run_ranks({"job": JOB, **spec}, world, out, timeout=600)
    assert error is None, error
    return results[0]["critic_layout_job"]


# each test's runs; the selected tests' runs share one request per world size (`runs`)
RUNS = {
    "test_two_critic_layouts_take_the_same_steps_and_score_the_same_values": {
        "one": (PACKED_ONE, {}),
        "two": (PADDED_TWO, {}),
        "plain/one": (PACKED_ONE, {"invariant": False}),
        "plain/two": (PADDED_TWO, {"invariant": False}),
    },
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, completions) -> dict:
    wanted = selected_runs(request, RUNS)
    specs = {name: _spec(completions, layout, **kw) for name, (layout, kw) in wanted.items()}
    return run_worlds(JOB, specs, tmp_path_factory.mktemp("critic"))


def _differing_state(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def test_two_critic_layouts_take_the_same_steps_and_score_the_same_values(runs):
    one, two = runs["one"], runs["two"]
    assert _differing_state(one["state"], two["state"]) == []
    assert one["metrics"] == two["metrics"]  # critic/value_loss, clip_fraction, updates, skips
    assert all(torch.equal(a, b) for a, b in zip(one["values"], two["values"], strict=True))
    assert one["metrics"][0]["critic/updates"] == 1 and one["updates"] == 3
    assert one["metrics"][-1]["critic/value_loss"] > 0
    assert bool((one["values"][-1] != 0).any())  # a later step's V_old: the critic learnt
    assert int(one["state"]["step"]) == 3

    # negative control: the plain update's sums follow the layout
    plain = [runs["plain/one"], runs["plain/two"]]
    assert _differing_state(plain[0]["state"], plain[1]["state"]) != []


@pytest.mark.exhaustive
@pytest.mark.parametrize(
    ("before", "after"), [(PADDED_TWO, PACKED_ONE), (PACKED_ONE, PADDED_TWO)], ids=["2to1", "1to2"]
)
def test_a_critic_state_saved_on_one_layout_resumes_on_another(
    tmp_path, completions, before, after
):
    """1to2: ZeRO-3 restores the 1-element value-head bias into a padded partition."""
    whole = _run(tmp_path, completions, before, steps=2)
    saved = tmp_path / "critic_ckpt"
    _run(tmp_path, completions, before, steps=1, save=str(saved), save_after=1)
    resumed = _run(tmp_path, completions, after, steps=1, resume=str(saved))
    assert _differing_state(whole["state"], resumed["state"]) == []
    assert resumed["metrics"][0] == whole["metrics"][1]
    assert torch.equal(resumed["values"][0], whole["values"][1])
    assert resumed["updates"] == whole["updates"]
