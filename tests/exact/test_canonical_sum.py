"""rl_engine.exact.canonical_sum: one sum of per-sequence partials, bit for bit, whatever the split.

The chain checked: for random splits of one list of n leaves into contiguous rank ranges (1, 2,
4 and odd rank counts, empty ranks too) and, inside each rank, micro-batches of random sizes,
the root `combine` evaluates from the holders' covers == the canonical tree evaluated by a plain
recursive reference (torch's `left + right` at every node), compared as integers so that NaN
payloads and signed zeros count. Therefore every split gives the same bits. The leaves are
adversarial: heavy cancellation around 1e30, subnormals, a 2^60 range, signed zeros, inf and NaN.
Dense and row partials agree at any thread count. Negative control: gradient
accumulation's left-to-right sum of micro-batch sums gives other bits for some split.
"""

import random

import pytest
import torch

from rl_engine.exact.canonical_sum import (
    CanonicalSum,
    combine,
    cover,
    depth,
    is_node,
    split_point,
)
from rl_engine.exact.row_partial import RowPartial
from tests.helpers.canonical_sums import (
    adversarial_leaves,
    assert_same_bits,
    bits_of,
    expected_sum,
    random_split,
    sum_split,
)

DTYPES = [torch.float32, torch.bfloat16]
NS = [1, 2, 3, 5, 7, 8, 13, 16, 24, 31, 32, 33, 48, 64, 70]


def _clone(leaves):
    return [leaf.clone() for leaf in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
def test_every_split_gives_the_canonical_trees_bits(n, dtype):
    leaves = adversarial_leaves(n, dtype, seed=n)
    want = expected_sum(leaves)
    rng = random.Random(n)
    for _ in range(10):
        split = random_split(n, rng)
        assert_same_bits(sum_split(n, _clone(leaves), split, rng), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_adversarial_values_are_in_the_sum(dtype):
    """The kinds reach the root: all -0.0 sums to -0.0, inf + -inf to NaN, NaN stays, the
    cancellation column ends far below its 1e30 terms and is not one value."""
    n = 24
    leaves = adversarial_leaves(n, dtype, seed=3)
    root, kind = expected_sum(leaves).flatten(), torch.arange(leaves[0].numel()) % 8
    assert torch.equal(bits_of(root[kind == 3]), bits_of(torch.full_like(root[kind == 3], -0.0)))
    assert root[kind == 5].isnan().all() and root[kind == 6].isnan().all()
    assert root[kind == 7].isinf().all()
    assert (root[kind == 1] != 0).any()
    biggest = max(float(leaf.flatten()[kind == 0].abs().max()) for leaf in leaves)
    assert biggest > 1e29 and float(root[kind == 0].abs().max()) < biggest / 10
    assert root[kind == 0].unique().numel() > 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_bits_do_not_depend_on_the_thread_count(dtype):
    """Leaves of 70k elements: torch splits each add between threads (and a bf16 NaN's bits
    follow its place in a thread's chunk); 1 and 2 threads, dense and row partials, agree."""
    n, shape = 5, (350, 200)
    values = adversarial_leaves(n, dtype, seed=11, shape=shape)
    rows = [torch.arange(s, shape[0], 1 + s) for s in range(n)]  # every row in leaf 0
    leaves = [RowPartial(r, v[r]).densify(shape) for r, v in zip(rows, values)]
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            split = [[(0, 2), (2, 5)]]
            dense = sum_split(n, _clone(leaves), split, random.Random(0))
            parts = [RowPartial(r, v[r].clone()) for r, v in zip(rows, values)]
            sparse = sum_split(n, parts, split, random.Random(0)).densify(shape)
            got += [dense, sparse]
    finally:
        torch.set_num_threads(before)
    for other in got[1:]:
        assert_same_bits(other, got[0])
    assert got[0].isnan().any()


def test_the_negative_control_plain_accumulation_depends_on_the_split():
    """What gradient accumulation does today: each micro-batch summed left to right, the
    micro-batch sums added in order. On the cancellation values its bits follow the split."""
    n = 32
    leaves = adversarial_leaves(n, torch.float32, seed=7)
    sums = set()
    for size in (1, 2, 3, 8, 32):
        total = None
        for lo in range(0, n, size):
            batch = leaves[lo].clone()
            for leaf in leaves[lo + 1 : lo + size]:
                batch = batch + leaf
            total = batch if total is None else total + batch
        sums.add(tuple(bits_of(total).flatten().tolist()))
    assert len(sums) > 1
    tree = set()
    for size in (1, 2, 3, 8, 32):
        split = [[(lo, min(lo + size, n)) for lo in range(0, n, size)]]
        tree.add(
            tuple(bits_of(sum_split(n, _clone(leaves), split, random.Random(0))).flatten().tolist())
        )
    assert len(tree) == 1


# ----------------------------------------------------------------------------- the tree's shape


def test_split_points_and_nodes():
    assert [split_point(0, k) for k in (2, 3, 4, 5, 8, 9, 24)] == [1, 2, 2, 4, 4, 8, 16]
    assert split_point(16, 24) == 20
    assert is_node(24, 0, 16) and is_node(24, 16, 24) and is_node(24, 20, 22)
    assert not is_node(24, 0, 12) and not is_node(24, 8, 24) and not is_node(24, 0, 25)
    assert cover(24, 3, 21) == [(3, 4), (4, 8), (8, 16), (16, 20), (20, 21)]
    with pytest.raises(ValueError, match=r"\[3, 4\) is a leaf"):
        split_point(3, 4)


def test_a_holder_keeps_its_cover_and_at_most_2_depth_plus_1_tensors():
    rng = random.Random(0)
    for n in range(1, 71):
        ranges = [(0, n), (0, rng.randint(0, n))] + [
            tuple(sorted(rng.randint(0, n) for _ in range(2))) for _ in range(12)
        ]
        for lo, hi in ranges:
            total = CanonicalSum(n, lo, hi)
            for s in range(lo, hi):
                total.push(s, torch.ones(1))
            assert [(a, b) for a, b, _ in total.nodes()] == cover(n, lo, hi)
            assert len(cover(n, lo, hi)) <= max(1, 2 * depth(n))
            assert total.peak_held <= 2 * depth(n) + 1
            if lo == 0 and hi:
                assert total.peak_held <= depth(hi) + 1
            assert sum(float(v) for _, _, v in total.nodes()) == hi - lo


# ----------------------------------------------------------------------------- errors


def test_leaves_come_in_order():
    total = CanonicalSum(8, 2, 6)
    with pytest.raises(ValueError, match="expected index 2, got 3"):
        total.push(3, torch.zeros(2))
    total.push(2, torch.zeros(2))
    with pytest.raises(ValueError, match="expected index 3, got 2"):
        total.push(2, torch.zeros(2))
    for s in range(3, 6):
        total.push(s, torch.zeros(2))
    with pytest.raises(
        ValueError, match=r"\[6, 7\) is not a node .* inside this holder's \[2, 6\)"
    ):
        total.push(6, torch.zeros(2))
    with pytest.raises(ValueError, match=r"not a node of the canonical tree of 4 leaves"):
        CanonicalSum(4).push_node(0, 3, torch.zeros(2))
    with pytest.raises(ValueError, match=r"the root needs every leaf of \[0, 8\)"):
        total.result()


def test_combine_names_the_gap_or_the_overlap():
    node = lambda lo, hi: (lo, hi, torch.zeros(1))  # noqa: E731
    with pytest.raises(ValueError, match=r"leave \[16, 20\) of \[0, 24\) uncovered"):
        combine(24, [node(20, 24), node(0, 16)])
    with pytest.raises(ValueError, match=r"node \[8, 16\) overlaps \[8, 16\)"):
        combine(24, [node(0, 16), node(8, 16), node(16, 24)])
    with pytest.raises(ValueError, match=r"leave \[16, 24\) of \[0, 24\) uncovered"):
        combine(24, [node(0, 16)])
    with pytest.raises(ValueError, match=r"\[0, 12\) is not a node of the canonical tree of 24"):
        combine(24, [node(0, 12), node(12, 24)])


def test_partials_that_would_break_the_in_place_adds_are_refused():
    total = CanonicalSum(4)
    buffer = torch.zeros(4, 3)
    total.push(0, buffer[0])
    total.push(1, buffer[1])  # disjoint memory of one buffer: fine
    with pytest.raises(ValueError, match=r"shares memory with node \[0, 2\)"):
        total.push(2, buffer[0])
    with pytest.raises(ValueError, match="one dtype, device and row shape"):
        total.push(2, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="expanded"):
        total.push(2, torch.zeros(1).expand(3))
    with pytest.raises(ValueError, match="must not require grad"):
        total.push(2, torch.zeros(3, requires_grad=True))
