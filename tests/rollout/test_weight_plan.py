"""Weight-sync pieces in one process: the index arithmetic, the plans, and the receiver's checks.

The chain: for any shape, any sender ranges and any one-dimension slice (several
ranges), the receiver's shard assembled from every piece (`target_view` <- the
sender's `source_elements`) equals `full[slice]` exactly (torch.equal); the
pieces of a whole tensor or a dim-0 slice are views of the sender's storage.
"""

from __future__ import annotations

import random

import pytest
import torch

from rl_engine.rollout.weight_pieces import plan_pieces, source_elements, target_view
from rl_engine.rollout.weight_plan import DimSlice, TensorSpec, WeightManifest, WeightPlan
from rl_engine.rollout.weight_receiver import WeightReceiver
from tests.helpers.rollout.common import fresh_model


def _shard(full: torch.Tensor, piece: DimSlice | None) -> torch.Tensor:
    if piece is None:
        return full
    return torch.cat([full.narrow(piece.dim, a, b - a) for a, b in piece.ranges], dim=piece.dim)


def _assemble(full, spec, manifest, plan, bucket_bytes, *, views: list | None = None):
    """The receiver's shard built piece by piece from each sender's own range of `full`."""
    target = torch.full(plan.target_shape(spec), -1.0, dtype=full.dtype)
    held = [full.reshape(-1)[lo:hi].clone() for lo, hi in spec.sources]
    for bucket in plan_pieces(manifest, plan, 0, bucket_bytes):
        assert sum(p.numel for p in bucket) * full.element_size() <= max(
            bucket_bytes, full.element_size()
        )
        for piece in bucket:
            data = source_elements(
                held[piece.sender], spec, piece.sender, plan.slices[spec.name], piece
            )
            if views is not None:
                views.append(
                    data.untyped_storage().data_ptr()
                    == held[piece.sender].untyped_storage().data_ptr()
                )
            target_view(target, piece).copy_(data)
    return target


def _random_case(rng: random.Random):
    shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
    numel = torch.Size(shape).numel()
    senders = rng.randint(1, 3)
    cuts = sorted(rng.randint(0, numel) for _ in range(senders - 1))
    bounds = [0, *cuts, numel]
    spec = TensorSpec("w", shape, "float32", tuple(zip(bounds[:-1], bounds[1:])))
    piece = None
    if rng.random() < 0.8:
        dim = rng.randrange(len(shape))
        points = sorted(
            rng.sample(range(shape[dim] + 1), k=min(shape[dim] + 1, 2 * rng.randint(1, 2)))
        )
        ranges = tuple((points[i], points[i + 1]) for i in range(0, len(points) - 1, 2))
        piece = DimSlice(dim, ranges)
    return spec, WeightManifest((spec,), senders), WeightPlan({"w": piece})


def test_pieces_assemble_every_slice_of_every_split_exactly():
    rng = random.Random(7)
    for _ in range(1500):
        spec, manifest, plan = _random_case(rng)
        full = torch.randn(spec.shape)
        bucket = rng.choice([4, 12, 40, 1 << 20])
        got = _assemble(full, spec, manifest, plan, bucket)
        assert torch.equal(got, _shard(full, plan.slices["w"])), (spec, plan, bucket)


def test_a_wrong_offset_would_be_seen():
    """Negative control: shifting one piece's destination by one element breaks the equality."""
    spec = TensorSpec("w", (6, 5), "float32", ((0, 13), (13, 30)))
    manifest, plan = WeightManifest((spec,), 2), WeightPlan({"w": DimSlice(1, ((1, 4),))})
    full = torch.randn(6, 5)
    target = torch.zeros(6, 3)
    held = [full.reshape(-1)[lo:hi] for lo, hi in spec.sources]
    (bucket,) = plan_pieces(manifest, plan, 0, 1 << 20)
    for piece in bucket:
        data = source_elements(held[piece.sender], spec, piece.sender, plan.slices["w"], piece)
        shift = 1 if piece.sender == 1 else 0
        target.view(-1)[piece.start - shift : piece.stop - shift].copy_(data)
    assert not torch.equal(target, full[:, 1:4])


@pytest.mark.parametrize("piece", [None, DimSlice(0, ((2, 5),))], ids=["whole", "rows"])
def test_whole_tensors_and_row_slices_are_sent_from_the_senders_storage(piece):
    spec = TensorSpec("w", (7, 4), "float32", ((0, 11), (11, 28)))
    manifest, plan = WeightManifest((spec,), 2), WeightPlan({"w": piece})
    views: list[bool] = []
    full = torch.randn(7, 4)
    assert torch.equal(
        _assemble(full, spec, manifest, plan, 1 << 20, views=views), _shard(full, piece)
    )
    assert views and all(views)


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
