"""Mismatch metrics between two sets of per-token logprobs (trainer vs. rollout).

The exact-match fraction comes first: with batch-invariant kernels it must be
1.0, and no tolerance hides a near miss. The rest are the metrics the RL
community reports (verl, slime, vLLM): |dlogp|, k3 KL, probability difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class MismatchMetrics:
    num_tokens: int
    exact_match_fraction: float
    max_abs_diff: float
    mean_abs_diff: float
    k3_kl: float
    """mean of exp(r) - r - 1 with r = rollout - trainer: KL(rollout || trainer) estimate."""
    mean_abs_prob_diff: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _check(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None):
    if trainer.shape != rollout.shape:
        raise ValueError(
            f"trainer logprobs {tuple(trainer.shape)} and rollout logprobs {tuple(rollout.shape)} differ in shape"
        )
    if mask is not None and mask.shape != trainer.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(trainer.shape)}")


def mismatch_metrics(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None
) -> MismatchMetrics:
    """Compare logprobs on the tokens `mask` selects (all tokens when None)."""
    _check(trainer, rollout, mask)
    keep = torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.bool()
    a, b = trainer[keep].double(), rollout[keep].double()
    n = a.numel()
    if n == 0:
        return MismatchMetrics(0, 1.0, 0.0, 0.0, 0.0, 0.0)
    diff = a - b
    r = -diff  # log(p_rollout / p_trainer)
    return MismatchMetrics(
        num_tokens=n,
        exact_match_fraction=float((trainer[keep] == rollout[keep]).double().mean()),
        max_abs_diff=float(diff.abs().max()),
        mean_abs_diff=float(diff.abs().mean()),
        k3_kl=float((torch.expm1(r) - r).mean()),
        mean_abs_prob_diff=float((a.exp() - b.exp()).abs().mean()),
    )


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
