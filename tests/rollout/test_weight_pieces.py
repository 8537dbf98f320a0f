"""Weight-sync pieces (rollout/weight_pieces.py) in one process: the index arithmetic.

The chain: for any shape, any sender ranges and any one-dimension slice (several
ranges), the receiver's shard assembled from every piece (`target_view` <- the
sender's `source_elements`) equals `full[slice]` exactly (torch.equal); the
pieces of a whole tensor or a dim-0 slice are views of the sender's storage.
Negative control: a piece written one element off breaks the equality.
"""

from __future__ import annotations

import random

import pytest
import torch

from rl_engine.rollout.weight_pieces import plan_pieces, source_elements, target_view
from rl_engine.rollout.weight_plan import DimSlice, TensorSpec, WeightManifest, WeightPlan


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
