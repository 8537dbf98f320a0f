"""Where a backward writes each sequence's parameter-gradient partials: one canonical tree per
(parameter, role), whatever the layout (rl_engine/exact/canonical_sum.py)."""

from __future__ import annotations

import torch

from rl_engine.exact.canonical_sum import CanonicalSum, Node, combine, holder_range, sum_roles
from rl_engine.exact.row_partial import RowPartial
from rl_engine.base.slab_arena import SlabArena


class SequenceGradients:
    """Where a backward writes each sequence's parameter-gradient partials, to be summed by the
    canonical tree (module docstring) whatever the layout.

    One holder serves the contiguous range [lo, hi) of the step's n sequences (a rank's shard;
    the whole step on one process). For each (parameter, role) it keeps one `CanonicalSum`
    over [lo, hi); a role names how the parameter was used: a tied weight is written as
    "embedding" by the embedding's backward and as "lm_head" by the LM head's, and its gradient
    is tree(embedding) + tree(lm_head) (`sum_roles`: roles in sorted order), never one tree of
    per-sequence h_s + e_s. The partials of one (parameter, role) come in increasing sequence
    index, every index of [lo, hi) once; a sequence that does not touch the parameter still
    gives its leaf: `add_rows` with no rows (the +0.0 leaf, which costs nothing).

    A partial is fp32 (fp64 for an fp64 parameter), on the parameter's device, shaped as the
    parameter was at its first partial (a partitioned parameter may be empty later). It
    becomes the holder's (the sums add into it in place). A deferred product counts as the
    dense tensor it stands for.

    Memory: each (parameter, role) holds at most 2 * depth(n) + 1 tensors (depth(n) =
    ceil(log2 n)), each shaped as the parameter, or as the union of its sequences' rows for a
    row partial; a holder of [0, m) (lo = 0) at most ceil(log2 m) + 1. A deferred product
    holds its operands instead, while they are smaller than the dense tensor. The first
    leaf of each dense tree, into which the holder's later leaves are added, lives in a slab
    (rl_engine/base/slab_arena.py), off the heap's short-lived tensors.
    """

    def __init__(self, n: int, lo: int = 0, hi: int | None = None):
        self.n, self.lo, self.hi = holder_range(n, lo, hi)
        self._params: dict[int, tuple[torch.Tensor, torch.Size]] = {}  # id -> (param, shape)
        self._sums: dict[tuple[int, str], CanonicalSum] = {}
        self._arena = SlabArena()

    def add(self, param: torch.Tensor, role: str, index: int, partial: torch.Tensor) -> None:
        """Sequence `index`'s partial of `param` in `role`: a dense tensor, or a deferred
        product (kernels/common/product_partial.py) that stands for one."""
        shape = self._shape(param)
        if tuple(partial.shape) != tuple(shape):
            raise ValueError(
                f"a partial of shape {tuple(partial.shape)} for a parameter of {tuple(shape)}"
            )
        self._check_dtype(param, partial)
        if index == self.lo and isinstance(partial, torch.Tensor):
            # the holder's first leaf: every later node of its range is added into it, so it
            # lives to the update, in a slab rather than among the heap's short-lived tensors
            partial = self._arena.adopt(partial)
        self._sum(param, role).push(index, partial)

    def add_rows(
        self, param: torch.Tensor, role: str, index: int, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Sequence `index`'s partial of `param` in `role` on `rows` only (+0.0 on the others)."""
        shape = self._shape(param)
        partial = RowPartial(rows, values)
        if tuple(values.shape[1:]) != tuple(shape[1:]):
            raise ValueError(
                f"rows of shape {tuple(values.shape[1:])} for a parameter of {tuple(shape)}"
            )
        if rows.numel() and int(rows[-1]) >= shape[0]:
            raise ValueError(f"row {int(rows[-1])} is outside the parameter's {shape[0]} rows")
        self._check_dtype(param, values)
        self._sum(param, role).push(index, partial)

    def params(self) -> list[torch.Tensor]:
        """The parameters written so far, in the order of their first partial."""
        return [param for param, _ in self._params.values()]

    def roles(self, param: torch.Tensor) -> list[str]:
        """The roles `param` was written in, sorted (the order `sum_roles` adds them)."""
        return sorted(role for key, role in self._sums if key == id(param))

    def nodes(self, param: torch.Tensor) -> dict[str, list[Node]]:
        """Each role's cover of [lo, hi): what this holder contributes to `param`'s gradient."""
        if id(param) not in self._params:
            raise ValueError(f"no partial was written for this parameter ({tuple(param.shape)})")
        covers = {}
        for role in self.roles(param):
            total = self._sums[id(param), role]
            if not total.complete:
                raise ValueError(
                    f"role {role!r} of [{self.lo}, {self.hi}) lacks the partials of sequences "
                    f"[{total.next_index}, {self.hi})"
                )
            covers[role] = total.nodes()
        return covers

    def result(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s gradient, when this holder holds the whole step [0, n)."""
        if (self.lo, self.hi) != (0, self.n):
            raise ValueError(
                f"this holder has sequences [{self.lo}, {self.hi}) of {self.n}: combine the "
                "holders' nodes (combine, then sum_roles)"
            )
        covers = self.nodes(param)
        roots = {role: combine(self.n, nodes) for role, nodes in covers.items()}
        return sum_roles(self._params[id(param)][1], roots)

    def release(self, param: torch.Tensor) -> None:
        """Forget `param`'s partials (once its gradient is formed): their memory goes with them."""
        for role in self.roles(param):
            for node in self._sums.pop((id(param), role)).nodes():
                if isinstance(node.value, torch.Tensor):
                    self._arena.release(node.value)

    def held(self) -> int:
        """How many partial-sized tensors the holder keeps now."""
        return sum(len(total.nodes()) for total in self._sums.values())

    def peak_held(self) -> int:
        """The sum over (parameter, role) of the most tensors each held at once (a bound on the
        most the holder held at once: the parameters peak at different times)."""
        return sum(total.peak_held for total in self._sums.values())

    def _shape(self, param: torch.Tensor) -> torch.Size:
        """The parameter's shape at its first partial."""
        return self._params[id(param)][1] if id(param) in self._params else param.shape

    def _sum(self, param: torch.Tensor, role: str) -> CanonicalSum:
        key = (id(param), role)
        if key not in self._sums:
            self._params.setdefault(id(param), (param, param.shape))  # held: its id stays its own
            self._sums[key] = CanonicalSum(self.n, self.lo, self.hi)
        return self._sums[key]

    @staticmethod
    def _check_dtype(param: torch.Tensor, partial: torch.Tensor) -> None:
        want = torch.float64 if param.dtype == torch.float64 else torch.float32
        if partial.dtype != want or partial.device != param.device:
            raise ValueError(
                f"a partial of a {param.dtype} parameter on {param.device} is {want} there, "
                f"got {partial.dtype} on {partial.device}"
            )
