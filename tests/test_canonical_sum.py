"""rl_engine.exact.canonical_sum: one sum of per-sequence partials, bit for bit, whatever the split.

The chain checked: for random splits of one list of n leaves into contiguous rank ranges (1, 2,
4 and odd rank counts, empty ranks too) and, inside each rank, micro-batches of random sizes,
the root `combine` evaluates from the holders' covers == the canonical tree evaluated by a plain
recursive reference (torch's `left + right` at every node), compared as integers so that NaN
payloads and signed zeros count. Therefore every split gives the same bits. The leaves are
adversarial: heavy cancellation around 1e30, subnormals, a 2^60 range, signed zeros, inf and NaN.
Row partials == their densified forms, through the same splits. Negative control: gradient
accumulation's left-to-right sum of micro-batch sums gives other bits for some split.
"""

import math
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
    sum_roles,
)
from rl_engine.exact.row_partial import RowPartial
from rl_engine.exact.sequence_gradients import SequenceGradients
from tests.helpers.canonical_sums import (
    adversarial_leaves,
    assert_same_bits,
    bits_of,
    reference_sum,
)

DTYPES = [torch.float32, torch.bfloat16]
NS = [1, 2, 3, 5, 7, 8, 13, 16, 24, 31, 32, 33, 48, 64, 70]


# ----------------------------------------------------------------------------- the reference


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """bf16: every NaN as 0x7FC0 (torch's bf16 add gives a NaN's bits by its place)."""
    if t.dtype != torch.bfloat16:
        return t
    bits = t.view(torch.int16).clone()
    bits[t.isnan()] = 0x7FC0
    return bits.view(torch.bfloat16)


def _expected(leaves: list[torch.Tensor]) -> torch.Tensor:
    return _canonical(reference_sum(leaves, 0, len(leaves)))


# ----------------------------------------------------------------------------- adversarial leaves


def _clone(leaves):
    return [leaf.clone() for leaf in leaves]


# ----------------------------------------------------------------------------- splits


def _random_split(n: int, rng: random.Random) -> list[list[tuple[int, int]]]:
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


def _sum_split(n: int, leaves, split, rng: random.Random):
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
def test_every_split_gives_the_canonical_trees_bits(n, dtype):
    leaves = adversarial_leaves(n, dtype, seed=n)
    want = _expected(leaves)
    rng = random.Random(n)
    for _ in range(10):
        split = _random_split(n, rng)
        assert_same_bits(_sum_split(n, _clone(leaves), split, rng), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_adversarial_values_are_in_the_sum(dtype):
    """The kinds reach the root: all -0.0 sums to -0.0, inf + -inf to NaN, NaN stays, the
    cancellation column ends far below its 1e30 terms and is not one value."""
    n = 24
    leaves = adversarial_leaves(n, dtype, seed=3)
    root, kind = _expected(leaves).flatten(), torch.arange(leaves[0].numel()) % 8
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
            dense = _sum_split(n, _clone(leaves), split, random.Random(0))
            parts = [RowPartial(r, v[r].clone()) for r, v in zip(rows, values)]
            sparse = _sum_split(n, parts, split, random.Random(0)).densify(shape)
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
            tuple(
                bits_of(_sum_split(n, _clone(leaves), split, random.Random(0))).flatten().tolist()
            )
        )
    assert len(tree) == 1


# ----------------------------------------------------------------------------- row partials


def _row_leaves(n: int, dtype, seed: int, rows_total: int = 40, width: int = 9):
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 24, 33])
def test_row_partials_sum_as_their_dense_forms(n, dtype):
    partials, dense = _row_leaves(n, dtype, seed=n)
    want = _expected(dense)
    rng = random.Random(n)
    for _ in range(6):
        split = _random_split(n, rng)
        got = _sum_split(n, [RowPartial(p.rows, p.values.clone()) for p in partials], split, rng)
        assert_same_bits(got.densify(want.shape), want)
        mixed = [p if s % 3 else d.clone() for s, (p, d) in enumerate(zip(partials, dense))]
        mixed = [
            RowPartial(m.rows, m.values.clone()) if isinstance(m, RowPartial) else m for m in mixed
        ]
        got = _sum_split(n, mixed, split, rng)
        got = got.densify(want.shape) if isinstance(got, RowPartial) else got
        assert_same_bits(got, want)


def test_a_row_in_one_child_gets_its_plus_zero():
    """-0.0 held by one child becomes +0.0 (the dense add's -0.0 + 0.0); inf and NaN stay."""
    left = RowPartial(torch.tensor([0, 2]), torch.tensor([[-0.0], [math.inf]]))
    right = RowPartial(torch.tensor([1, 2]), torch.tensor([[-0.0], [1.0]]))
    total = CanonicalSum(2)
    total.push(0, left)
    total.push(1, right)
    got = total.result().densify((4, 1))
    assert_same_bits(got, torch.tensor([[0.0], [0.0], [math.inf], [0.0]]))


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
    with pytest.raises(ValueError, match="sorted, unique"):
        RowPartial(torch.tensor([2, 1]), torch.zeros(2, 3))


# ----------------------------------------------------------------------------- the sink


def test_sequence_gradients_split_over_ranks_equal_one_holder_and_the_trees():
    """A tied weight written as 'lm_head' (dense) and 'embedding' (rows), and a plain weight:
    ranks' holders combined == one holder == tree(embedding) + tree(lm_head) (roles sorted)."""
    n, shape = 13, (40, 9)
    tied, other = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(3, 2)
    rows, dense_rows = _row_leaves(n, torch.float32, seed=5)
    heads = adversarial_leaves(n, torch.float32, seed=6, shape=shape)
    others = adversarial_leaves(n, torch.float32, seed=8, shape=(3, 2))

    def holder(lo, hi):
        sink = SequenceGradients(n, lo, hi)
        for s in range(lo, hi):
            sink.add(tied, "lm_head", s, heads[s].clone())
            sink.add_rows(tied, "embedding", s, rows[s].rows, rows[s].values.clone())
            sink.add(other, "linear", s, others[s].clone())
        return sink

    whole = holder(0, n)
    assert [id(p) for p in whole.params()] == [id(tied), id(other)]
    assert whole.roles(tied) == ["embedding", "lm_head"]
    want = reference_sum(dense_rows, 0, n) + reference_sum(heads, 0, n)
    assert_same_bits(whole.result(tied), want)
    assert_same_bits(whole.result(other), reference_sum(others, 0, n))
    ranks = [holder(0, 5), holder(5, 6), holder(6, 13)]
    assert sum(rank.held() for rank in ranks) <= 3 * 3 * (2 * depth(n) + 1)
    for param, expected in ((tied, want), (other, reference_sum(others, 0, n))):
        covers = [rank.nodes(param) for rank in ranks]
        roots = {role: combine(n, [nd for c in covers for nd in c[role]]) for role in covers[0]}
        assert_same_bits(sum_roles(param.shape, roots), expected)


def test_sequence_gradients_errors():
    param = torch.zeros(4, 3)
    sink = SequenceGradients(6, 2, 5)
    with pytest.raises(ValueError, match=r"shape \(3,\) for a parameter of \(4, 3\)"):
        sink.add(param, "linear", 2, torch.zeros(3))
    with pytest.raises(ValueError, match="is torch.float32 there, got torch.float64"):
        sink.add(param, "linear", 2, torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="row 4 is outside the parameter's 4 rows"):
        sink.add_rows(param, "embedding", 2, torch.tensor([4]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="no partial was written"):
        sink.nodes(param)
    sink.add(param, "linear", 2, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"lacks the partials of sequences \[3, 5\)"):
        sink.nodes(param)
    with pytest.raises(ValueError, match=r"expected index 3, got 4"):
        sink.add(param, "linear", 4, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"holder has sequences \[2, 5\) of 6"):
        sink.result(param)
