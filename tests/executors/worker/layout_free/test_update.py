"""The layout-free update on real DeepSpeed ranks (gloo): the same whole gradients give the same
weights and AdamW moments, bit for bit, on 1, 2 and 4 ranks at every ZeRO stage, fp32 and bf16;
(a state gathered on one layout resuming on another: test_state.py).

Negative control: torch's AdamW with DeepSpeed's own clip (the plain path) on the same
gradients gives different bits between layouts (bf16 ZeRO-0's optimizer takes a zero-gradient
step at construction, which decays the weights and shifts the bias correction). The selected
tests' runs share one launch per world size (the `runs` fixture).

In-process: a sequence gets the same decoder and logprob spans (its lengths, in canonical order)
padded or packed, and the parameters whose partials outgrow a slab form their gradients last.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.base.slab_arena import SLAB_BYTES
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.layout_free.update import micro_batch_spans, release_order
from rl_engine.executors.worker.micro_batches import plan
from tests.helpers.worker.completions import two_groups
from tests.helpers.worker.launch import selected_runs
from tests.helpers.worker.layout_free_runs import assert_same_state, run_layout_frees

LAYOUTS = [(1, 0), (2, 3), (4, 1), (2, 2)]  # (ranks, ZeRO stage)
# each test's runs ({name: (ranks, stage, dtype, optimizer)}); the selected tests' runs share
# one launch per world size (`runs`)
RUNS = {
    **{
        f"test_every_layout_updates_to_the_same_bits[{dtype}]": {
            f"{dtype}/{world}_{stage}": (world, stage, dtype, "invariant")
            for world, stage in LAYOUTS
        }
        for dtype in ("float32", "bfloat16")
    },
    "test_negative_control_torch_adamw_and_deepspeeds_clip_differ_between_layouts": {
        "torch/one": (1, 0, "bfloat16", "torch"),
        "torch/two": (2, 3, "bfloat16", "torch"),
    },
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("layout_free")
    return run_layout_frees(out_dir, selected_runs(request, RUNS))


def _bits_differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[key], b[key]) for key in a)


@pytest.mark.exhaustive  # make test: the worker's and the job's layout tests use this path
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layout_updates_to_the_same_bits(runs, dtype):
    first, *others = (runs[f"{dtype}/{world}_{stage}"] for world, stage in LAYOUTS)
    for run in others:
        assert_same_state(first["state"], run["state"])
        assert run["norms"] == first["norms"]
    assert int(first["state"]["step"]) == 2
    assert first["norms"][0] > 1.0  # the clip acted


def test_negative_control_torch_adamw_and_deepspeeds_clip_differ_between_layouts(runs):
    one, two = runs["torch/one"], runs["torch/two"]
    assert _bits_differ(one["state"], two["state"])


def test_a_sequence_has_the_same_spans_padded_or_packed():
    comps, rewards = two_groups()
    batch = TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)
    indices = [4, 5, 6, 7]  # canonical: this shard's first row is the mini-batch's fifth
    (padded,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=False)
    (packed,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=True)
    padded_decoder, padded_logp = micro_batch_spans(padded, indices)
    packed_decoder, packed_logp = micro_batch_spans(packed, indices)
    lengths = tuple(batch.attention_mask.sum(dim=1).tolist())
    assert padded_decoder.lengths == packed_decoder.lengths == lengths
    assert padded_logp.lengths == packed_logp.lengths == tuple(n - 1 for n in lengths)
    assert padded_decoder.indices == packed_decoder.indices == tuple(indices)
    # negative control: the layouts do differ, in the rows the spans start at
    assert padded_decoder.starts != packed_decoder.starts


def test_parameters_larger_than_a_quarter_slab_form_their_gradients_last():
    large = SLAB_BYTES // 16 + 1  # elements whose fp32 partials outgrow a quarter slab
    sizes = [large, 3, large, 5]
    params = [torch.empty(n, dtype=torch.bool) for n in sizes]
    assert release_order(params) == [1, 3, 0, 2]
