"""A partial held as the GEMMs that make it: the dense partial's bits, a block of rows at a time.

The LM head's partial of one sequence, g_s^T h_s, is (V, H) fp32 (113 MiB for SmolLM2's
49152 x 576), while its operands, the sequence's n_s rows of g (V, n_s) and of h (H, n_s) in the
parameter's dtype, take n_s / H of that in bf16 (a few MiB at n_s ~ 100). A `ProductPartial`
keeps the operands; a `ProductSum` is left + right of two deferred values, unevaluated. Either
is evaluated a block of output rows at a time (`block(lo, hi)`):

- a term is the backend's ExactGemm on rows lo..hi-1 of its left operand, and an ExactGemm's
  output row m depends on a[m], b, K and N alone (common/sequence_grads.py), so a block's rows
  are the whole product's rows, bit for bit;
- the terms add elementwise in order (acc = term 0, acc + term 1, ...) and a sum is left + right,
  the order the dense evaluation adds them in.

So `densify` (into a fresh buffer), `add_into` (dense + deferred, into the dense buffer) and
`add_before` (deferred + dense, into the dense buffer) give the dense evaluation's bits, while
besides the destination only one block of the dense value exists at a time, and no add pass
reads back a whole partial. The products are fp32 (fp64 for fp64 operands), whose adds' NaNs
do not depend on an element's place (rl_engine/exact/canonical_sum.py), so blocks cannot change them.

The canonical tree keeps a sum deferred while its operands take no more memory than its dense
value (`add_deferred`), and evaluates it into its destination when it meets a dense node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_engine.kernels.common.checks import at_least_fp32

# a (M, K), b (N, K) -> (M, N), row m a function of a[m], b, K and N alone (`ExactGemm`)
Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

BLOCK_ELEMENTS = 1 << 20
"""Output elements of one evaluated block (4 MiB in fp32): small against the dense value, large
enough that a GEMM call's fixed cost does not show."""


@dataclass(frozen=True, eq=False)
class ProductPartial:
    """The dense (M, N) value gemm(a_0, b_0) + gemm(a_1, b_1) + ..., added left to right, kept
    as its terms: a_j (M, K_j) and b_j (N, K_j), contiguous, in one dtype and on one device."""

    gemm: Gemm
    terms: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def __post_init__(self):
        if not self.terms:
            raise ValueError("a ProductPartial needs at least one (a, b) term")
        a0, b0 = self.terms[0]
        for j, (a, b) in enumerate(self.terms):
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[1] == 0:
                raise ValueError(
                    f"term {j}: a (M, K) and b (N, K) with K > 0, got {tuple(a.shape)} and "
                    f"{tuple(b.shape)}"
                )
            if a.shape[0] != a0.shape[0] or b.shape[0] != b0.shape[0]:
                raise ValueError(
                    f"term {j}: every term makes one (M, N) = ({a0.shape[0]}, {b0.shape[0]}), "
                    f"got ({a.shape[0]}, {b.shape[0]})"
                )
            for t in (a, b):
                if t.dtype != a0.dtype or t.device != a0.device:
                    raise ValueError(
                        f"term {j}: operands in one dtype and device, {a0.dtype} on "
                        f"{a0.device}, got {t.dtype} on {t.device}"
                    )
                if not t.is_contiguous() or t.requires_grad:
                    raise ValueError(f"term {j}: operands must be contiguous and not require grad")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.terms[0][0].shape[0], self.terms[0][1].shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return at_least_fp32(self.terms[0][0].dtype)

    @property
    def device(self) -> torch.device:
        return self.terms[0][0].device

    def factors(self) -> list[torch.Tensor]:
        return [t for term in self.terms for t in term]

    def block(self, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1 of the dense value, a fresh tensor."""
        (a, b), rest = self.terms[0], self.terms[1:]
        acc = self.gemm(a[lo:hi], b)
        for a, b in rest:
            acc.add_(self.gemm(a[lo:hi], b))
        return acc


@dataclass(frozen=True, eq=False)
class ProductSum:
    """left + right, both deferred, of one shape and dtype, unevaluated."""

    left: Deferred
    right: Deferred

    def __post_init__(self):
        left, right = self.left, self.right
        if (left.shape, left.dtype, left.device) != (right.shape, right.dtype, right.device):
            raise ValueError(
                f"a sum of deferred partials of one kind: {tuple(left.shape)} {left.dtype} on "
                f"{left.device}, got {tuple(right.shape)} {right.dtype} on {right.device}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.left.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.left.dtype

    @property
    def device(self) -> torch.device:
        return self.left.device

    def factors(self) -> list[torch.Tensor]:
        return self.left.factors() + self.right.factors()

    def block(self, lo: int, hi: int) -> torch.Tensor:
        return self.left.block(lo, hi).add_(self.right.block(lo, hi))


Deferred = ProductPartial | ProductSum


def is_deferred(value) -> bool:
    return isinstance(value, ProductPartial | ProductSum)


def factor_bytes(value: Deferred) -> int:
    """The memory its operands take (a factor shared by two terms counted once)."""
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in value.factors()}
    return sum(unique.values())


def dense_bytes(value: Deferred) -> int:
    rows, cols = value.shape
    return rows * cols * torch.empty((), dtype=value.dtype).element_size()


def _blocks(value: Deferred):
    rows, cols = value.shape
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


def densify(value: Deferred) -> torch.Tensor:
    """The dense value, in a fresh buffer."""
    out = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    for lo, hi in _blocks(value):
        out[lo:hi] = value.block(lo, hi)
    return out


def add_into(dense: torch.Tensor, value: Deferred) -> torch.Tensor:
    """dense + value, written into `dense` (the bits of `dense.add_(densify(value))`)."""
    for lo, hi in _blocks(value):
        dense[lo:hi].add_(value.block(lo, hi))
    return dense


def add_before(value: Deferred, dense: torch.Tensor) -> torch.Tensor:
    """value + dense, written into `dense` (the bits of `densify(value).add_(dense)`: the left
    operand stays left, which a NaN's payload can tell)."""
    for lo, hi in _blocks(value):
        dense[lo:hi] = value.block(lo, hi).add_(dense[lo:hi])
    return dense


def add_deferred(left: Deferred, right: Deferred) -> Deferred | torch.Tensor:
    """left + right: kept deferred while its operands take no more memory than its dense value,
    else evaluated into a fresh buffer."""
    return settled(ProductSum(left, right))


def settled(value: Deferred) -> Deferred | torch.Tensor:
    """`value`, evaluated when its operands take more memory than its dense value would."""
    return value if factor_bytes(value) <= dense_bytes(value) else densify(value)


def dense(value) -> torch.Tensor:
    """A partial as a dense tensor (a dense one as it is)."""
    return densify(value) if is_deferred(value) else value
