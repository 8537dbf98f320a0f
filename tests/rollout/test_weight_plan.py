"""Weight-sync plans (rollout/weight_plan.py): splits that cover a tensor and check their names,
partial plans that keep the named tensors' slices and count their bytes once.

(The pieces' index arithmetic: test_weight_pieces.py; the receiver's checks:
test_weight_receiver.py.)
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout.weight_plan import DimSlice, WeightManifest, WeightPlan


def test_split_plans_cover_the_tensor_and_check_their_names():
    manifest = WeightManifest.even_split(
        [("a.weight", (8, 6), torch.float32, ()), ("b.bias", (8,), torch.float32, ())], 2
    )
    plans = [WeightPlan.split(manifest, {"a.weight": 0, "b.bias": 0}, r, 2) for r in range(2)]
    assert [p.slices["a.weight"] for p in plans] == [DimSlice(0, ((0, 4),)), DimSlice(0, ((4, 8),))]
    with pytest.raises(ValueError, match=r"dim 1 of shape \(8, 6\) does not split into 4"):
        WeightPlan.split(manifest, {"a.weight": 1}, 0, 4)
    with pytest.raises(ValueError, match="'c.weight'"):
        WeightPlan({"c.weight": None}).check(manifest)
    with pytest.raises(ValueError, match="ranges .* increasing"):
        WeightPlan({"a.weight": DimSlice(1, ((3, 5), (1, 2)))}).check(manifest)


def test_a_partial_plan_keeps_the_named_tensors_slices_and_counts_their_bytes_once():
    """A LoRA policy's later syncs: the receivers' plans restricted to the adapters."""
    manifest = WeightManifest.even_split(
        [
            ("a", (4, 6), torch.float32, ()),
            ("b", (8,), torch.bfloat16, ("b_tied",)),
            ("c", (2, 2), torch.float32, ()),
        ],
        2,
    )
    plan = WeightPlan.split(manifest, {"a": 0}, 1, 2)
    partial = plan.only(["a", "c"])
    assert dict(partial.slices) == {"a": plan.slices["a"], "c": None}
    partial.check(manifest)
    assert manifest.nbytes_of(["a", "c"]) == (24 + 4) * 4
    assert manifest.nbytes_of(["b"]) == 16 and manifest.nbytes == 24 * 4 + 16 + 16
    with pytest.raises(ValueError, match="partial plan names 'z'"):
        plan.only(["a", "z"])
