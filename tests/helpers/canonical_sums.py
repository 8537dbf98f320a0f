"""Adversarial leaves and the canonical tree written out: the canonical-sum tests' references."""

from __future__ import annotations

import math

import torch

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
