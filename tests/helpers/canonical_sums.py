"""Adversarial leaves and the canonical tree written out: the canonical-sum tests' references."""

from __future__ import annotations

import math
import random

import torch

from rl_engine.exact.canonical_sum import CanonicalSum, combine, cover
from rl_engine.exact.row_partial import RowPartial

INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
LEAF_SHAPE = (5, 53)  # 265 elements: a SIMD body and a scalar tail in every add


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(bits_of(got), bits_of(want))


def reference_sum(leaves: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """The canonical tree over leaves[lo:hi], written out: split at the largest power of two
    below the length, left + right out of place."""
    if hi - lo == 1:
        return leaves[lo].clone()
    p = 1
    while 2 * p < hi - lo:
        p *= 2
    return reference_sum(leaves, lo, lo + p) + reference_sum(leaves, lo + p, hi)


def adversarial_leaves(
    n: int, dtype: torch.dtype, seed: int, shape=LEAF_SHAPE
) -> list[torch.Tensor]:
    """n leaves of `shape`; element e holds kind e % 8 in every leaf (each kind in the body and
    the tail of an add): cancellation (terms of +-1e30 that cancel over the leaves, and 1e-3
    ones), subnormals, a 2^60 range, all -0.0, mixed zeros, +inf and -inf in two leaves, NaN
    (two payloads, either sign) in one leaf, inf in one leaf."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    sign = torch.where(torch.rand(n, numel, generator=g) < 0.5, -1.0, 1.0).double()
    u = 1 + torch.rand(n, numel, generator=g, dtype=torch.float64)
    perm = torch.randperm(n, generator=g)  # +-1e30 terms that cancel over the leaves
    cancel = 1e30 * (u - u[perm]) + sign * u * 1e-3
    subnormal = sign * torch.randint(1, 2**20, (n, numel), generator=g).double() * 2.0**-149
    wide = sign * u * torch.exp2(torch.randint(-30, 31, (n, numel), generator=g).double())
    kinds = [cancel, subnormal, wide, torch.full((n, numel), -0.0, dtype=torch.float64)]
    kinds.append(sign * 0.0)
    kinds += [torch.zeros(n, numel, dtype=torch.float64) + sign for _ in range(3)]
    kind = torch.arange(numel) % len(kinds)
    values = torch.stack(kinds)[kind, :, torch.arange(numel)].T.contiguous()  # (n, numel)
    first = torch.randint(0, n, (numel,), generator=g)
    other = (first + 1 + torch.randint(0, max(n - 1, 1), (numel,), generator=g)) % n
    pick = torch.stack([first, other], 1)  # two different leaves where n > 1
    cols = torch.arange(numel)
    values[pick[:, 0], cols] = torch.where(kind == 5, math.inf, values[pick[:, 0], cols])
    values[pick[:, 1], cols] = torch.where(kind == 5, -math.inf, values[pick[:, 1], cols])
    values[pick[:, 0], cols] = torch.where(kind == 7, math.inf, values[pick[:, 0], cols])
    out = values.to(dtype)
    nan_bits = {torch.float32: (0x7FC01234, -0x003FFFBE), torch.bfloat16: (0x7FC1, -0x003D)}
    bits = out.view(INT_OF[dtype])
    payload = torch.tensor(nan_bits[dtype], dtype=INT_OF[dtype])
    is_nan_kind = kind == 6
    bits[pick[:, 0][is_nan_kind], cols[is_nan_kind]] = payload[(cols[is_nan_kind] // 8) % 2]
    return list(out.view(n, *shape).unbind(0))


def canonical_nans(t: torch.Tensor) -> torch.Tensor:
    """bf16: every NaN as 0x7FC0 (torch's bf16 add gives a NaN's bits by its place)."""
    if t.dtype != torch.bfloat16:
        return t
    bits = t.view(torch.int16).clone()
    bits[t.isnan()] = 0x7FC0
    return bits.view(torch.bfloat16)


def expected_sum(leaves: list[torch.Tensor]) -> torch.Tensor:
    return canonical_nans(reference_sum(leaves, 0, len(leaves)))


def random_split(n: int, rng: random.Random) -> list[list[tuple[int, int]]]:
    """Ranks (contiguous, possibly empty ranges) of micro-batches (sizes 1..k)."""
    ranks = rng.choice([1, 2, 4, 3, 5, 7])
    cuts = sorted(rng.randint(0, n) for _ in range(ranks - 1))
    bounds = [0, *cuts, n]
    k = rng.randint(1, 9)
    split = []
    for lo, hi in zip(bounds, bounds[1:]):
        batches, at = [], lo
        while at < hi:
            size = min(rng.randint(1, k), hi - at)
            batches.append((at, at + size))
            at += size
        split.append(batches)
    return split


def sum_split(n: int, leaves, split, rng: random.Random):
    """The root from the ranks' covers: each micro-batch a holder whose nodes its rank takes
    (or the rank takes the leaves itself), the ranks' nodes combined in a shuffled list."""
    gathered = []
    for batches in split:
        lo, hi = (batches[0][0], batches[-1][1]) if batches else (0, 0)
        rank = CanonicalSum(n, lo, hi)
        for b_lo, b_hi in batches:
            if rng.random() < 0.5:
                for s in range(b_lo, b_hi):
                    rank.push(s, leaves[s])
                continue
            batch = CanonicalSum(n, b_lo, b_hi)
            for s in range(b_lo, b_hi):
                batch.push(s, leaves[s])
            for node in batch.nodes():
                rank.push_node(*node)
        assert rank.complete
        assert [(a, b) for a, b, _ in rank.nodes()] == cover(n, lo, hi)
        gathered += rank.nodes()
    rng.shuffle(gathered)
    return combine(n, gathered)


def row_leaves(n: int, dtype, seed: int, rows_total: int = 40, width: int = 9):
    """n row partials of a (rows_total, width) tensor with adversarial values, and their dense
    forms. Rows 0..7 are each held by one leaf only (left and right children alike: such a row
    meets +0.0 at every add); the others by each leaf with chance 0, 0.2, 0.6 or 1 (s % 4)."""
    g = torch.Generator().manual_seed(seed + 1)
    values = adversarial_leaves(n, dtype, seed, shape=(rows_total, width))
    solo = torch.arange(8) * n // 8  # the leaf of each solo row
    partials, dense = [], []
    for s in range(n):
        keep = torch.rand(rows_total, generator=g) < [0.0, 0.2, 0.6, 1.0][s % 4]
        keep[:8] = solo == s
        rows = keep.nonzero().flatten()
        partials.append(RowPartial(rows, values[s][rows].clone()))
        dense.append(partials[-1].densify((rows_total, width)))
    return partials, dense
