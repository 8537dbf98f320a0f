"""Mismatch between two sets of per-token logprobs (trainer vs. rollout): the one definition.

Both the worker's `parity/*` step metrics and the diagnostics' report come from
`parity_sums`, a vector of sums that adds up over micro-batches and ranks
(`merge_sums`, `reduce_sums`) and turns into metrics at the end.

The exact-match fraction comes first: with batch-invariant kernels it must be
1.0, and no tolerance hides a near miss. The rest are the metrics the RL
community reports: |dlogp|, the k3 estimate of KL(rollout || trainer) (tokens
are sampled from the rollout), and the probability difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from rl_engine.algorithms import kl_k3

# entries of the sums vector; MAX is the one reduced with max instead of sum
EXACT, TOKENS, ABS_SUM, ABS_MAX, K3_SUM, PROB_ABS_SUM = range(6)
NUM_SUMS = 6


def _check(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None):
    if trainer.shape != rollout.shape:
        raise ValueError(
            f"trainer logprobs {tuple(trainer.shape)} and rollout logprobs {tuple(rollout.shape)} differ in shape"
        )
    if mask is not None and mask.shape != trainer.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(trainer.shape)}")


def parity_sums(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(6,) fp64 CPU [exact matches, tokens, sum |d|, max |d|, sum k3, sum |dprob|] over `mask`'s tokens."""
    _check(trainer, rollout, mask)
    keep = torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.bool()
    a, b = trainer[keep], rollout[keep]
    if a.numel() == 0:
        return torch.zeros(NUM_SUMS, dtype=torch.float64)
    diff = (a.double() - b.double()).abs()
    k3 = kl_k3(b, a)  # KL(rollout || trainer): samples come from the rollout
    prob = (a.double().exp() - b.double().exp()).abs()
    values = [(a == b).sum(), a.numel(), diff.sum(), diff.max(), k3.double().sum(), prob.sum()]
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def merge_sums(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    merged = total + part
    merged[ABS_MAX] = torch.maximum(total[ABS_MAX], part[ABS_MAX])
    return merged


def reduce_sums(sums: torch.Tensor, all_reduce) -> torch.Tensor:
    """Sums over ranks; `all_reduce(tensor, op)` with op 'sum' or 'max'."""
    out = all_reduce(sums, "sum")
    out[ABS_MAX] = all_reduce(sums[ABS_MAX : ABS_MAX + 1], "max")[0]
    return out


@dataclass(frozen=True)
class MismatchMetrics:
    num_tokens: int
    exact_match_fraction: float
    max_abs_diff: float
    mean_abs_diff: float
    k3_kl: float
    """Mean k3 estimate of KL(rollout || trainer) over the tokens."""
    mean_abs_prob_diff: float

    @classmethod
    def from_sums(cls, sums: torch.Tensor) -> MismatchMetrics:
        values = sums.tolist()
        tokens = values[TOKENS]
        if tokens == 0:
            return cls(0, 1.0, 0.0, 0.0, 0.0, 0.0)
        return cls(
            num_tokens=int(tokens),
            exact_match_fraction=values[EXACT] / tokens,
            max_abs_diff=values[ABS_MAX],
            mean_abs_diff=values[ABS_SUM] / tokens,
            k3_kl=values[K3_SUM] / tokens,
            mean_abs_prob_diff=values[PROB_ABS_SUM] / tokens,
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def step_metrics(self) -> dict[str, float]:
        """The worker's `parity/*` entries of a step's metrics."""
        return {
            "parity/exact_match_fraction": self.exact_match_fraction,
            "parity/max_abs_diff": self.max_abs_diff,
            "parity/mean_abs_diff": self.mean_abs_diff,
            "parity/kl": self.k3_kl,
            "parity/num_tokens": self.num_tokens,
        }


def mismatch_metrics(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None
) -> MismatchMetrics:
    """Compare logprobs on the tokens `mask` selects (all tokens when None)."""
    return MismatchMetrics.from_sums(parity_sums(trainer, rollout, mask))


def first_mismatch(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None):
    """(sequence, position, trainer value, rollout value) of the first unequal token, or None."""
    _check(trainer, rollout, mask)
    bad = trainer != rollout
    if mask is not None:
        bad &= mask.bool()
    hits = bad.nonzero()
    if hits.numel() == 0:
        return None
    seq, pos = (int(v) for v in hits[0])
    return seq, pos, float(trainer[seq, pos]), float(rollout[seq, pos])
