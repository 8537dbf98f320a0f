"""trainer.layout_invariant with a LoRA policy (rank 4 on every linear, base frozen): two layouts
(1 rank ZeRO-0 micro-batch 8 packed, 2 ranks ZeRO-3 micro-batch 2 padded) end every step with
the same adapters and AdamW moments, bit for bit, and write the same metrics; the layout-free
state holds the adapters alone, a checkpoint saved on one layout resumes on the other and
continues exactly, and one resumed onto another base is refused (its content hash). Negative
control: the same layouts with the flag off differ. The selected tests' runs share one request
per world size (the `runs` fixture).
"""

from __future__ import annotations

import pytest

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.patching.lora import is_adapter_name
from tests.helpers.worker.cell import cached_completions, cell_config, to_batch
from tests.helpers.worker.launch import selected_runs
from tests.helpers.worker.layout_runs import (
    PACKED_ONE,
    PADDED_TWO,
    layout_pair,
    run_layout,
    run_layouts,
    same_metrics,
    same_state,
)

LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
# each test's runs; the selected tests' runs share one request per world size (`runs`)
RUNS = {
    **{
        f"test_two_layouts_take_the_same_lora_steps[{dtype}]": layout_pair(dtype, dtype, lora=LORA)
        for dtype in ("float32", "bfloat16")
    },
    "test_negative_control_the_plain_lora_update_differs_between_layouts": layout_pair(
        "plain", "float32", lora=LORA, invariant=False
    ),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, completions) -> dict:
    out_dir = tmp_path_factory.mktemp("lora")
    return run_layouts(out_dir, completions, selected_runs(request, RUNS))


def _lora_run(tmp_path, completions, layout, dtype, **extra):
    return run_layout(tmp_path, completions, layout, dtype, lora=LORA, **extra)


def _check_adapters_trained(state: dict) -> None:
    """The state holds the adapters alone (no frozen base weight), and B (zero at the start)
    has moved."""
    names = [key for key in state if key != "step" and "/" not in key]
    assert names and all(is_adapter_name(name) for name in names)
    assert any(".lora_B." in name and state[name].any() for name in names)


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.exhaustive)]
)
def test_two_layouts_take_the_same_lora_steps(runs, dtype):
    one, two = runs[f"{dtype}/one"], runs[f"{dtype}/two"]
    _check_adapters_trained(one["state"])
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert int(one["state"]["step"]) == 3


@pytest.mark.exhaustive  # make test: the policy's negative control (test_layout_invariance.py)
def test_negative_control_the_plain_lora_update_differs_between_layouts(runs):
    one, two = runs["plain/one"], runs["plain/two"]
    assert same_state(one["state"], two["state"]) != []


@pytest.mark.exhaustive
def test_a_lora_checkpoint_saved_on_one_layout_resumes_on_another(tmp_path, completions):
    whole = _lora_run(tmp_path, completions, PADDED_TWO, "float32")
    ckpt = str(tmp_path / "ckpt")
    _lora_run(
        tmp_path, completions, PADDED_TWO, "float32", steps=1, save_checkpoint=ckpt, save_after=1
    )
    resumed = _lora_run(tmp_path, completions, PACKED_ONE, "float32", steps=2, load_checkpoint=ckpt)
    assert same_state(whole["state"], resumed["state"]) == []
    assert same_metrics(whole["metrics"][1:], resumed["metrics"]) == []


def _worker(seed: int) -> DeepSpeedTrainingWorker:
    config = cell_config(
        0,
        1,
        "float32",
        seed=seed,
        trainer={"layout_invariant": True, "micro_batch_size": 8, "packing": True},
        lora=LORA,
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def test_a_lora_checkpoint_resumed_on_another_base_is_refused(tmp_path):
    trained = _worker(seed=3)
    trained.train_step(to_batch(cached_completions("float32")).shard(0, 1))
    trained.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"lora: checkpoint .* holds adapters of base .* hash"):
        _worker(seed=4).load_checkpoint(tmp_path / "ckpt")
    _worker(seed=3).load_checkpoint(tmp_path / "ckpt")  # its own base resumes
