"""Mismatch between two sets of per-token logprobs (trainer vs. rollout): the one definition.

Both the worker's `parity/*` step metrics and the diagnostics' report come from
`parity_sums`, a `ParitySums` record that adds up over micro-batches and ranks
(`merge`, `all_reduce`: `rl_engine.exact.records`) and turns into metrics at the end.

The exact-match fraction comes first: with batch-invariant kernels it must be
1.0, and no tolerance hides a near miss. The rest are the metrics the RL
community reports: |dlogp|, the k3 estimate of KL(rollout || trainer) (tokens
are sampled from the rollout), and the probability difference.

The importance ratio trainer / rollout, exp(trainer - rollout) = p_trainer(token)
/ p_rollout(token), is the weight that corrects a policy gradient taken on
samples the rollout engine drew; with bitwise parity it is exactly 1. Its
distribution (`ratio_distribution`: min, max, quantiles, fraction outside
[1/C, C] per token and per sequence, the sequence ratio being exp of the sum of
its token log-ratios) and `mismatch_by_position` serve the diagnostics;
`correction_sums` (a `CorrectionSums` record) and its `metrics` are the worker's
`correction/*` step metrics (what the rollout correction truncated or dropped),
summed over micro-batches and ranks like `parity_sums`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from rl_engine.algorithms import kl_k3
from rl_engine.exact.records import Sums, maximum


def _check(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None):
    if trainer.shape != rollout.shape:
        raise ValueError(
            f"trainer logprobs {tuple(trainer.shape)} and rollout logprobs {tuple(rollout.shape)} differ in shape"
        )
    if mask is not None and mask.shape != trainer.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(trainer.shape)}")


@dataclass(frozen=True, slots=True)
class ParitySums(Sums):
    """Sums over the compared tokens that the mismatch metrics are read from."""

    exact: float = 0.0
    """Tokens whose trainer and rollout logprobs are equal (==)."""
    tokens: float = 0.0
    """Tokens compared."""
    abs_sum: float = 0.0
    """Sum of |trainer - rollout| (fp64)."""
    abs_max: float = maximum()
    """Largest |trainer - rollout|."""
    k3_sum: float = 0.0
    """Sum of the k3 estimate of KL(rollout || trainer)."""
    prob_abs_sum: float = 0.0
    """Sum of |p_trainer - p_rollout| of the tokens."""

    @property
    def mismatches(self) -> float:
        """Tokens whose logprobs differ."""
        return self.tokens - self.exact


def parity_sums(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None
) -> ParitySums:
    """The parity sums of the tokens `mask` selects (all tokens when None)."""
    _check(trainer, rollout, mask)
    keep = torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.bool()
    a, b = trainer[keep], rollout[keep]
    if a.numel() == 0:
        return ParitySums()
    diff = (a.double() - b.double()).abs()
    k3 = kl_k3(b, a)  # KL(rollout || trainer): samples come from the rollout
    prob = (a.double().exp() - b.double().exp()).abs()
    return ParitySums(
        exact=float((a == b).sum()),
        tokens=float(a.numel()),
        abs_sum=float(diff.sum()),
        abs_max=float(diff.max()),
        k3_sum=float(k3.double().sum()),
        prob_abs_sum=float(prob.sum()),
    )


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
    def from_sums(cls, sums: ParitySums) -> MismatchMetrics:
        tokens = sums.tokens
        if tokens == 0:
            return cls(0, 1.0, 0.0, 0.0, 0.0, 0.0)
        return cls(
            num_tokens=int(tokens),
            exact_match_fraction=sums.exact / tokens,
            max_abs_diff=sums.abs_max,
            mean_abs_diff=sums.abs_sum / tokens,
            k3_kl=sums.k3_sum / tokens,
            mean_abs_prob_diff=sums.prob_abs_sum / tokens,
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


# ---------------------------------------------------------------------------- importance ratios

THRESHOLDS = (1.5, 2.0, 5.0)
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)


def _flat_log_ratios(trainer: Sequence[torch.Tensor], rollout: Sequence[torch.Tensor]):
    if len(trainer) != len(rollout):
        raise ValueError(f"{len(trainer)} trainer sequences but {len(rollout)} rollout sequences")
    for i, (a, b) in enumerate(zip(trainer, rollout)):
        if a.shape != b.shape:
            raise ValueError(
                f"sequence {i}: trainer logprobs {tuple(a.shape)} and rollout logprobs "
                f"{tuple(b.shape)} differ in shape"
            )
    return [a.double() - b.double() for a, b in zip(trainer, rollout)]


def ratio_distribution(
    trainer: Sequence[torch.Tensor],
    rollout: Sequence[torch.Tensor],
    thresholds: Sequence[float] = THRESHOLDS,
    quantiles: Sequence[float] = QUANTILES,
) -> dict:
    """Token and sequence importance ratios of per-sequence logprob vectors (one tensor each).

    Returns {"token": {min, max, mean, quantiles {q: value}, outside {C: fraction}},
    "sequence": {min, max, outside {C: fraction}}}; fractions outside [1/C, C].
    """
    per_seq = _flat_log_ratios(trainer, rollout)
    if not per_seq or sum(r.numel() for r in per_seq) == 0:
        raise ValueError("no tokens: the ratio distribution needs at least one")
    tokens = torch.cat(per_seq).exp()
    sequences = torch.stack([r.sum() for r in per_seq]).exp()
    q = torch.quantile(tokens, torch.tensor(list(quantiles), dtype=torch.float64))
    return {
        "token": {
            "min": float(tokens.min()),
            "max": float(tokens.max()),
            "mean": float(tokens.mean()),
            "quantiles": {str(k): float(v) for k, v in zip(quantiles, q)},
            "outside": {str(c): fraction_outside(tokens, c) for c in thresholds},
        },
        "sequence": {
            "min": float(sequences.min()),
            "max": float(sequences.max()),
            "outside": {str(c): fraction_outside(sequences, c) for c in thresholds},
        },
    }


def fraction_outside(ratios: torch.Tensor, threshold: float) -> float:
    """Fraction of `ratios` outside [1/threshold, threshold]."""
    if not threshold > 1:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    outside = (ratios < 1.0 / threshold) | (ratios > threshold)
    return float(outside.double().mean())


def mismatch_by_position(
    trainer: Sequence[torch.Tensor], rollout: Sequence[torch.Tensor]
) -> dict[str, list]:
    """Per completion position p (0 = first sampled token), over the sequences that reach it:
    {"tokens": count, "exact_match_fraction", "mean_abs_diff", "max_abs_diff"} as lists."""
    per_seq = _flat_log_ratios(trainer, rollout)
    width = max((r.numel() for r in per_seq), default=0)
    count = torch.zeros(width, dtype=torch.float64)
    exact = torch.zeros(width, dtype=torch.float64)
    abs_sum = torch.zeros(width, dtype=torch.float64)
    abs_max = torch.zeros(width, dtype=torch.float64)
    for a, b, d in zip(trainer, rollout, per_seq):
        n = d.numel()
        count[:n] += 1
        exact[:n] += (a == b).double()
        abs_sum[:n] += d.abs()
        abs_max[:n] = torch.maximum(abs_max[:n], d.abs())
    seen = count.clamp(min=1)
    return {
        "tokens": [int(c) for c in count],
        "exact_match_fraction": (exact / seen).tolist(),
        "mean_abs_diff": (abs_sum / seen).tolist(),
        "max_abs_diff": abs_max.tolist(),
    }


# ---------------------------------------------------------------------------- per training step


@dataclass(frozen=True, slots=True)
class CorrectionSums(Sums):
    """A step's rollout-correction sums over its micro-batches and ranks; `metrics` reads them."""

    tokens: float = 0.0
    """Completion tokens the correction saw."""
    truncated: float = 0.0
    """Tokens whose importance weight was truncated."""
    dropped: float = 0.0
    """Tokens the correction masked out."""
    ratio_sum: float = 0.0
    """Sum of the token ratios trainer / rollout."""
    ratio_max: float = maximum(-math.inf)
    """Largest token ratio."""
    neg_ratio_min: float = maximum(-math.inf)
    """Minus the smallest token ratio (a max, so that one all-reduce op serves both)."""
    k3_sum: float = 0.0
    """Sum of the k3 estimate of KL(rollout || trainer)."""
    trainer_logp_sum: float = 0.0
    rollout_logp_sum: float = 0.0
    sequences: float = 0.0
    """Sequences with a completion token."""
    dropped_sequences: float = 0.0
    """Sequences the correction left without a token."""

    def metrics(self) -> dict[str, float]:
        """`correction/*` metrics of a step: ratio stats, fractions truncated / masked, k3 KL,
        perplexities."""
        tokens = max(self.tokens, 1.0)
        return {
            "correction/ratio_mean": self.ratio_sum / tokens,
            "correction/ratio_min": -self.neg_ratio_min,
            "correction/ratio_max": self.ratio_max,
            "correction/truncated_fraction": self.truncated / tokens,
            "correction/masked_fraction": self.dropped / tokens,
            "correction/masked_sequence_fraction": self.dropped_sequences
            / max(self.sequences, 1.0),
            "correction/k3_kl": self.k3_sum / tokens,
            "correction/trainer_ppl": _exp(-self.trainer_logp_sum / tokens),
            "correction/rollout_ppl": _exp(-self.rollout_logp_sum / tokens),
        }


def correction_sums(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, correction
) -> CorrectionSums:
    """The correction sums of one micro-batch.

    trainer / rollout / mask: (B, T); `correction`: the RolloutCorrection applied to them.
    """
    valid = mask.bool()
    if not bool(valid.any()):
        return CorrectionSums()
    a, b = trainer.detach().double()[valid], rollout.double()[valid]
    ratio = torch.exp(a - b)
    has_tokens = valid.any(dim=1)
    dropped_rows = has_tokens & ~correction.mask.any(dim=1)
    k3 = kl_k3(rollout, trainer.detach(), mask=valid)  # KL(rollout || trainer)
    return CorrectionSums.from_tensors(
        tokens=valid.sum(),
        truncated=correction.truncated.sum(),
        dropped=correction.dropped.sum(),
        ratio_sum=ratio.sum(),
        ratio_max=ratio.max(),
        neg_ratio_min=-ratio.min(),
        k3_sum=k3.double().sum(),
        trainer_logp_sum=a.sum(),
        rollout_logp_sum=b.sum(),
        sequences=has_tokens.sum(),
        dropped_sequences=dropped_rows.sum(),
    )


def _exp(x: float) -> float:
    """math.exp, inf instead of OverflowError (a non-finite loss step still reports its metrics)."""
    return math.inf if x > 709.0 else math.exp(x)
