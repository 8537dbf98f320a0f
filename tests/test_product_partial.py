"""Deferred GEMM partials (kernels/common/product_partial.py) and the slab arena: evaluated a
block of rows at a time, summed by the canonical tree deferred or dense, they give the dense
partials' bits; the negative control, one GEMM over every sequence's rows, does not."""

from __future__ import annotations

import random

import pytest
import torch

from rl_engine.exact.canonical_sum import CanonicalSum, combine
from rl_engine.kernels.common import product_partial as pp
from rl_engine.kernels.common.product_partial import (
    ProductPartial,
    ProductSum,
    add_before,
    add_deferred,
    add_into,
    densify,
    is_deferred,
)
from rl_engine.kernels.cpp.linear import exact_gemm
from rl_engine.base.slab_arena import SlabArena
from tests.helpers.canonical_sums import adversarial_leaves, assert_same_bits, reference_sum

M, N = 37, 11  # a block of 3 rows leaves a short last block


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(pp, "BLOCK_ELEMENTS", 3 * N)


def _gemm(a, b):
    return exact_gemm(a, b)  # the cpp backend's, which serves every CPU


def _operands(k: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, k, generator=g) * 4).to(dtype)
    b = torch.randn(N, k, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_product_evaluated_in_blocks_is_the_whole_gemm(small_blocks, dtype):
    terms = [_operands(k, dtype, seed=k) for k in (5, 96, 1)]
    want = _gemm(*terms[0])
    for a, b in terms[1:]:
        want.add_(_gemm(a, b))
    assert_same_bits(densify(ProductPartial(_gemm, tuple(terms))), want)


def _leaf(values: torch.Tensor) -> ProductPartial:
    """A deferred leaf whose dense value is `values` (M, N) fp32, from two exact GEMM terms:
    a = values split in a bf16-exact head and the rest, b = ones (K = 1 each)."""
    head = values.to(torch.bfloat16).float()
    head = torch.where(torch.isfinite(values), head, values)  # inf and NaN ride in the head
    rest = torch.where(torch.isfinite(values), values - head, torch.zeros_like(values))
    ones = torch.ones(N, 1)
    return ProductPartial(
        _gemm, ((head[:, :1].contiguous(), ones), (rest[:, :1].contiguous(), ones))
    )


def _dense_leaf(leaf: ProductPartial) -> torch.Tensor:
    (a0, b0), (a1, b1) = leaf.terms
    return _gemm(a0, b0).add_(_gemm(a1, b1))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 24, 33])
def test_deferred_leaves_in_every_split_give_the_dense_trees_bits(small_blocks, n):
    """Adversarial values (cancellation, subnormals, a 2^60 range, signed zeros, inf, NaN):
    each leaf deferred or dense at random, pushed by random holders; the root's bits are the
    canonical tree's over the dense leaves."""
    values = [
        v.reshape(M, 1).expand(M, N).contiguous()
        for v in adversarial_leaves(n, torch.float32, seed=n, shape=(M,))
    ]
    deferred = [_leaf(v) for v in values]
    dense = [_dense_leaf(leaf) for leaf in deferred]
    want = reference_sum(dense, 0, n)
    rng = random.Random(n)
    for _ in range(6):
        leaves = [d if rng.random() < 0.6 else x.clone() for d, x in zip(deferred, dense)]
        cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(0, 3)))})
        nodes = []
        for lo, hi in zip(cuts, cuts[1:]):
            holder = CanonicalSum(n, lo, hi)
            for s in range(lo, hi):
                holder.push(s, leaves[s])
            nodes += holder.nodes()
        assert_same_bits(pp.dense(combine(n, nodes)), want)


def test_negative_control_one_gemm_over_every_sequence_differs():
    """The plain LM-head backward: one GEMM over all sequences' rows, not a tree of theirs."""
    terms = [_operands(96, torch.bfloat16, seed=s) for s in range(4)]
    tree = reference_sum([_gemm(a, b) for a, b in terms], 0, len(terms))
    whole = _gemm(torch.cat([a for a, _ in terms], 1), torch.cat([b for _, b in terms], 1))
    assert not torch.equal(tree, whole)


def test_the_blockwise_adds_are_the_dense_adds(small_blocks):
    left, right = (ProductPartial(_gemm, (_operands(9, torch.float32, s),)) for s in (1, 2))
    want = _dense_leaf_sum(left, right)
    assert_same_bits(add_into(densify(left), right), want)
    assert_same_bits(add_before(left, densify(right)), want)
    assert_same_bits(pp.dense(add_deferred(left, right)), want)


def _dense_leaf_sum(left, right):
    return densify(left).add_(densify(right))


def test_a_sum_stays_deferred_only_while_its_operands_are_smaller(small_blocks):
    small = [ProductPartial(_gemm, (_operands(1, torch.bfloat16, s),)) for s in range(2)]
    assert isinstance(add_deferred(*small), ProductSum)  # (37 + 11) x 2 x 2 B < 37 x 11 x 4 B
    big = [ProductPartial(_gemm, (_operands(40, torch.bfloat16, s),)) for s in range(2)]
    total = add_deferred(*big)
    assert isinstance(total, torch.Tensor) and not is_deferred(total)
    assert_same_bits(total, _dense_leaf_sum(*big))


def test_a_malformed_product_names_the_term():
    a, b = _operands(4, torch.float32, 0)
    with pytest.raises(ValueError, match="term 1"):
        ProductPartial(_gemm, ((a, b), (a[:, :3].contiguous(), b)))
    with pytest.raises(ValueError, match="at least one"):
        ProductPartial(_gemm, ())


# ----------------------------------------------------------------------------- the slab arena


def test_the_arena_keeps_values_and_drops_a_slab_with_its_last_slot():
    arena = SlabArena(slab_bytes=4096)
    tensors = [torch.randn(8, 8) for _ in range(5)]  # 256 B each: several to a slab
    slots = [arena.adopt(t.clone()) for t in tensors]
    assert all(torch.equal(s, t) for s, t in zip(slots, tensors))
    assert arena.slabs == 1
    big = torch.randn(40, 40)  # over a quarter slab: left to the allocator
    assert arena.adopt(big) is big
    for slot in slots[:-1]:
        arena.release(slot)
    assert arena.slabs == 1
    arena.release(slots[-1])
    assert arena.slabs == 0
    fresh = arena.adopt(torch.ones(3))
    assert arena.slabs == 1 and torch.equal(fresh, torch.ones(3))


def test_slots_do_not_overlap_and_start_aligned():
    arena = SlabArena(slab_bytes=1 << 16)
    slots = [arena.adopt(torch.full((n,), float(n))) for n in (1, 3, 17, 64)]
    for n, slot in zip((1, 3, 17, 64), slots):
        assert slot.data_ptr() % 64 == 0 and torch.equal(slot, torch.full((n,), float(n)))
