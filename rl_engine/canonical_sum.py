"""One sum of per-sequence partials for every split of the sequences: the canonical tree.

A step's n sequences have a canonical order 0..n-1, fixed by the data and never by the layout.
Sequence s contributes a partial g_s (a gradient, say). The step's sum is ONE binary tree over
0..n-1, the canonical tree of n leaves:

    a node [lo, hi) with hi - lo >= 2 splits at lo + p, p the largest power of two < hi - lo;
    a leaf [s, s + 1) is g_s; a node's value is left + right (one elementwise torch add).

The rule is the same at every node, so a node's subtree is the canonical tree of its length:
for n = 2^k the tree is perfect, for n = 24 the root is [0, 16) + [16, 24). A holder of any
contiguous range [a, b) (a micro-batch, a rank's shard, a range of ranks) computes every node
inside [a, b) and keeps the maximal ones, the cover of [a, b) (`cover`: at most
2 * ceil(log2 n) nodes); the root is then evaluated from the union of the holders' covers
(`combine`). Whatever the split, the same adds run on the same operands in the same order, so
the sum has the same bits: signed zeros, inf and NaN included, as torch's adds make them.

One exception, the bits of a NaN in bf16 (and fp16, treated alike): torch's CPU bf16 add
writes a NaN as 0xFFFF in its SIMD body and 0x7FC0 in its scalar tail (measured, torch 2.13 on
the AVX2 EPYC), and which elements fall in a tail depends on the tensor's length and the thread
count; a row partial's rows sit at other places than in the dense tensor. A root in a
reduced-precision dtype (`result`, `combine`, `sum_roles`) therefore has every NaN rewritten as
the dtype's one NaN, `torch.tensor(nan, dtype)` (0x7FC0 in bf16). fp32 and fp64 NaN keep the
bits the adds gave them (there the add's NaN does not depend on the place). A NaN stays a NaN
through every later add, so which elements are NaN never depends on the layout.

A partial is a dense tensor, a `RowPartial` (rows of a tensor, +0.0 elsewhere: an embedding's
per-sequence gradient) or a deferred product (`ProductPartial`, kernels/common/product_partial.py:
the LM head's per-sequence partial kept as its GEMM's operands). Row partials add as their
densified forms would, bit for bit: a row held by one child only still gets its `+ 0.0`
(which maps -0.0 to +0.0 and keeps inf and NaN). Deferred ones add unevaluated while their
operands take less memory than their dense value, and are evaluated a block of rows at a time
into the dense node they meet: the same adds on the same elements, so the same bits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rl_engine.kernels.common.product_partial import (
    Deferred,
    add_before,
    add_deferred,
    add_into,
    dense,
    is_deferred,
    settled,
)
from rl_engine.exact.row_partial import RowPartial, add_rows

_REDUCED = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- the tree


def split_point(lo: int, hi: int) -> int:
    """Where node [lo, hi) splits: lo + the largest power of two strictly less than hi - lo."""
    if hi - lo < 2:
        raise ValueError(f"[{lo}, {hi}) is a leaf or empty: only a node of 2 or more leaves splits")
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


def is_node(n: int, lo: int, hi: int) -> bool:
    """Whether [lo, hi) is a node of the canonical tree of n leaves (a walk down from the root)."""
    a, b = 0, n
    if not 0 <= lo < hi <= n:
        return False
    while (a, b) != (lo, hi):
        if b - a < 2:
            return False
        s = split_point(a, b)
        if hi <= s:
            b = s
        elif lo >= s:
            a = s
        else:
            return False
    return True


def cover(n: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal nodes of the canonical tree of n leaves inside [lo, hi), in order: what a
    holder of [lo, hi) keeps once it has every leaf of its range."""
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"[{lo}, {hi}) is not a range of the {n} leaves [0, {n})")
    found: list[tuple[int, int]] = []

    def walk(a: int, b: int) -> None:
        if lo <= a and b <= hi:
            found.append((a, b))
        elif a < hi and lo < b:
            s = split_point(a, b)
            walk(a, s)
            walk(s, b)

    if lo < hi:
        walk(0, n)
    return found


def depth(n: int) -> int:
    """The canonical tree's depth, ceil(log2 n): a cover holds at most max(1, 2 * depth(n)) nodes."""
    return (n - 1).bit_length() if n > 1 else 0


# ----------------------------------------------------------------------------- values


Value = torch.Tensor | RowPartial | Deferred


class Node(NamedTuple):
    """A node of the canonical tree and its value."""

    lo: int
    hi: int
    value: Value


def _add(left: Value, right: Value) -> Value:
    """left + right, elementwise, into the left buffer where it is one (a row partial's union
    rows, or a densified row partial, are fresh buffers)."""
    if isinstance(left, RowPartial) and isinstance(right, RowPartial):
        return add_rows(left, right)
    if is_deferred(left) or is_deferred(right):
        return _add_deferred(left, right)
    if isinstance(left, RowPartial):
        left = left.densify(right.shape)
    elif isinstance(right, RowPartial):
        right = right.densify(left.shape)
    return left.add_(right)  # the same kernel and bits as left + right


def _add_deferred(left: Value, right: Value) -> Value:
    """`_add` where a side is deferred: evaluated into the dense side's buffer, a block of rows
    at a time; two deferred sides stay deferred while that takes less memory."""
    if isinstance(left, RowPartial):
        left = left.densify(right.shape)
    elif isinstance(right, RowPartial):
        right = right.densify(left.shape)
    if is_deferred(left) and is_deferred(right):
        return add_deferred(left, right)
    return add_into(left, right) if is_deferred(right) else add_before(left, right)


def canonical_nan(value: Value) -> Value:
    """`value` with every NaN of a bf16 / fp16 tensor made the dtype's one NaN (module
    docstring: the payload of a reduced-precision add's NaN depends on the element's place)."""
    tensor = value.values if isinstance(value, RowPartial) else value
    if tensor.dtype in _REDUCED:
        nan = tensor.isnan()
        if bool(nan.any()):
            tensor.masked_fill_(nan, math.nan)
    return value


def value_tensors(value: Value) -> list[torch.Tensor]:
    """The tensors a value's bits live in (a deferred one's: its GEMM's operands)."""
    if isinstance(value, RowPartial):
        return [value.values]
    return value.factors() if is_deferred(value) else [value]


def _kind(value: Value) -> tuple[torch.dtype, torch.device, tuple[int, ...]]:
    """(dtype, device, row shape) of the dense tensor a value stands for."""
    tensor = value.values if isinstance(value, RowPartial) else value
    return tensor.dtype, tensor.device, tuple(tensor.shape[1:])


def _memory(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The byte range [start, end) a tensor's elements lie in (None when it has none)."""
    if tensor.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


# ----------------------------------------------------------------------------- the accumulator


def holder_range(n: int, lo: int, hi: int | None) -> tuple[int, int, int]:
    """(n, lo, hi) of a holder of the leaves [lo, hi) of n (hi None: n), checked."""
    hi = n if hi is None else hi
    if n < 1 or not 0 <= lo <= hi <= n:
        raise ValueError(f"a holder needs n >= 1 and 0 <= lo <= hi <= n, got n={n}, [{lo}, {hi})")
    return n, lo, hi


class CanonicalSum:
    """The canonical tree of n leaves, evaluated over the leaves lo..hi-1 as they stream in.

    `push(index, leaf)` takes the leaves in increasing, contiguous order; `push_node(lo, hi,
    value)` an already-combined node (from another holder). A node is merged as soon as both
    its children are held (a binary-counter stack), so at most the cover of what it holds plus
    the newcomer is held: 2 * depth(n) + 1 tensors (`peak_held` says how many it did).

    A pushed tensor becomes the accumulator's: a node's sum is written into its left child's
    buffer (`left.add_(right)`, the bits of `left + right`), so a pushed leaf may be modified
    and must not be pushed again or read afterwards. A leaf whose memory overlaps a value held
    here is refused (the in-place add would change the held value), as is a tensor that
    requires grad or repeats one element in memory (an expanded tensor). The tensors `nodes()`
    returns are still the accumulator's buffers: later pushes may add into them.
    """

    def __init__(self, n: int, lo: int = 0, hi: int | None = None):
        self.n, self.lo, self.hi = holder_range(n, lo, hi)
        self._next = lo
        self._stack: list[Node] = []
        self._kind: tuple[torch.dtype, torch.device, tuple[int, ...]] | None = None
        self.peak_held = 0

    @property
    def next_index(self) -> int:
        """The index the next leaf (or the next node's lo) must have."""
        return self._next

    @property
    def complete(self) -> bool:
        """Whether every leaf of [lo, hi) is in."""
        return self._next == self.hi

    def push(self, index: int, leaf: Value) -> None:
        """Leaf `index` (must be `next_index`): a tensor, or a `RowPartial`."""
        if index != self._next:
            raise ValueError(
                f"leaves come in increasing, contiguous order: expected index {self._next}, got {index}"
            )
        self.push_node(index, index + 1, leaf)

    def push_node(self, lo: int, hi: int, value: Value) -> None:
        """Node [lo, hi) of the canonical tree of n, already combined; lo must be `next_index`."""
        if lo != self._next:
            raise ValueError(
                f"node [{lo}, {hi}) does not continue the leaves held: expected lo {self._next}"
            )
        if hi > self.hi or not is_node(self.n, lo, hi):
            raise ValueError(
                f"[{lo}, {hi}) is not a node of the canonical tree of {self.n} leaves "
                f"inside this holder's [{self.lo}, {self.hi})"
            )
        if is_deferred(value):
            value = settled(value)
        self._check(value)
        self._next = hi
        self._stack.append(Node(lo, hi, value))
        self.peak_held = max(self.peak_held, len(self._stack))
        while len(self._stack) >= 2:
            left, right = self._stack[-2], self._stack[-1]
            if not is_node(self.n, left.lo, right.hi) or split_point(left.lo, right.hi) != left.hi:
                break
            self._stack[-2:] = [Node(left.lo, right.hi, _add(left.value, right.value))]

    def nodes(self) -> list[Node]:
        """The maximal nodes held, in order (after every leaf of [lo, hi): its cover)."""
        return list(self._stack)

    def result(self) -> Value:
        """The root, once this holder has every leaf of [0, n)."""
        if (self.lo, self.hi) != (0, self.n) or not self.complete:
            raise ValueError(
                f"the root needs every leaf of [0, {self.n}); this holder has [{self.lo}, {self._next})"
            )
        (root,) = self._stack
        return canonical_nan(dense(root.value))

    def _check(self, value: Value) -> None:
        """Every value alike (dtype, device, row shape); none sharing memory with a held one
        (two deferred ones may: neither is written)."""
        tensors = value_tensors(value)
        if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
            raise ValueError(
                f"a partial is a float tensor, a RowPartial or a ProductPartial, got "
                f"{type(value).__name__}"
            )
        if any(t.requires_grad for t in tensors):
            raise ValueError(
                "a partial must not require grad (detach it): it is added into in place"
            )
        for tensor in tensors:
            if any(st == 0 and size > 1 for size, st in zip(tensor.shape, tensor.stride())):
                raise ValueError(
                    "a partial must not repeat elements in memory (an expanded tensor)"
                )
        kind = _kind(value)
        if self._kind is None:
            self._kind = kind
        elif kind != self._kind:
            raise ValueError(
                f"every partial of one sum has one dtype, device and row shape: {self._kind}, got {kind}"
            )
        for node in self._stack:
            if is_deferred(value) and is_deferred(node.value):
                continue
            if any(_overlap(t, h) for t in tensors for h in value_tensors(node.value)):
                raise ValueError(
                    f"a partial shares memory with node [{node.lo}, {node.hi}) held here: "
                    "push tensors of their own (the held sum is added into in place)"
                )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    span, held = _memory(a), _memory(b)
    return bool(span and held and a.device == b.device and span[0] < held[1] and held[0] < span[1])


def combine(n: int, nodes: list[Node] | list[tuple[int, int, Value]]) -> Value:
    """The root of the canonical tree of n from nodes that cover [0, n) exactly, in any order
    (the covers of several holders together). The nodes' tensors become the sum's (see
    `CanonicalSum`)."""
    ordered = sorted((Node(*node) for node in nodes), key=lambda node: (node.lo, node.hi))
    at = 0
    for lo, hi, _ in ordered:
        if not is_node(n, lo, hi):
            raise ValueError(f"[{lo}, {hi}) is not a node of the canonical tree of {n} leaves")
        if lo > at:
            raise ValueError(f"the nodes leave [{at}, {lo}) of [0, {n}) uncovered")
        if lo < at:
            raise ValueError(
                f"node [{lo}, {hi}) overlaps [{lo}, {min(at, hi)}), covered by another"
            )
        at = hi
    if at != n:
        raise ValueError(f"the nodes leave [{at}, {n}) of [0, {n}) uncovered")
    total = CanonicalSum(n)
    for node in ordered:
        total.push_node(*node)
    return total.result()


def sum_roles(shape: tuple[int, ...] | torch.Size, roots: dict[str, Value]) -> torch.Tensor:
    """A tied parameter's gradient: the roots of its roles' trees, densified to `shape`, added
    left to right in the order of the role names (sorted: "embedding" before "lm_head"). Each
    role's tree is summed whole first: the per-sequence leaf is never h_s + e_s."""
    if not roots:
        raise ValueError("sum_roles needs the root of at least one role")
    total: torch.Tensor | None = None
    for role in sorted(roots):
        root = roots[role]
        dense_root = root.densify(shape) if isinstance(root, RowPartial) else dense(root)
        if tuple(dense_root.shape) != tuple(shape):
            raise ValueError(
                f"role {role!r}: a root of shape {tuple(dense_root.shape)}, expected {tuple(shape)}"
            )
        total = dense_root if total is None else total.add_(dense_root)
    return canonical_nan(total)
