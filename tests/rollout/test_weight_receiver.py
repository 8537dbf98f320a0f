"""The weight receiver's checks (rollout/weight_receiver.py), before any sync.

A receiver built from a model's state dict refuses, naming the tensor, a senders' manifest
that lacks one of its tensors, lists one it lacks, or sends another shape or dtype, and a
plan that leaves one of its tensors out. (The syncs themselves run over a real gloo group in
test_weight_sync.py.)
"""

from __future__ import annotations

import pytest

from rl_engine.rollout.weight_plan import TensorSpec, WeightManifest, WeightPlan
from rl_engine.rollout.weight_receiver import WeightReceiver
from tests.helpers.rollout.common import fresh_model


def _manifest_of(model, senders=2) -> WeightManifest:
    groups: dict[int, list[str]] = {}
    tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    return WeightManifest.even_split(
        [
            (names[0], tuple(tensors[k].shape), tensors[k].dtype, tuple(names[1:]))
            for k, names in groups.items()
        ],
        senders,
    )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda s: [t for t in s if t.name != "model.norm.weight"],
            r"receiver has tensor 'model.norm.weight', which the senders' manifest does not list",
        ),
        (
            lambda s: [*s, TensorSpec("model.extra", (2,), "float32", ((0, 1), (1, 2)))],
            r"lists 'model.extra', which the receiver lacks",
        ),
        (
            lambda s: [
                TensorSpec(s[0].name, (3, 3), "float32", ((0, 4), (4, 9)), s[0].aliases),
                *s[1:],
            ],
            r"'model.embed_tokens.weight'.*shape \(1031, 128\), the plan sends \(3, 3\)",
        ),
        (
            lambda s: [
                TensorSpec(s[0].name, s[0].shape, "bfloat16", s[0].sources, s[0].aliases),
                *s[1:],
            ],
            r"holds float32, the senders send bfloat16",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_receiver_refuses_a_manifest_that_does_not_fit_before_any_sync(edit, match):
    model = fresh_model("tiny-qwen2")
    good = _manifest_of(model)
    bad = WeightManifest(tuple(edit(list(good.tensors))), good.num_senders)
    with pytest.raises(ValueError, match=match):
        WeightReceiver(
            model.state_dict(keep_vars=True), bad, WeightPlan.everything(bad), 0, 1 << 20
        )


def test_receiver_refuses_a_plan_that_leaves_one_of_its_tensors_out():
    model = fresh_model("tiny-qwen2")
    manifest = _manifest_of(model)
    plan = WeightPlan.everything(manifest)
    partial = WeightPlan({k: v for k, v in plan.slices.items() if k != "model.norm.weight"})
    with pytest.raises(
        ValueError, match="does not send 'model.norm.weight', which the receiver holds"
    ):
        WeightReceiver(model.state_dict(keep_vars=True), manifest, partial, 0, 1 << 20)
