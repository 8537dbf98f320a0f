"""The importance ratio trainer / rollout and where in a sequence the two disagree.

ratio = exp(trainer logprob - rollout logprob) = p_trainer(token) / p_rollout(token),
the weight that corrects a policy gradient taken on samples drawn by the rollout
engine. With bitwise parity it is exactly 1 everywhere. The distribution (min,
max, quantiles, the fraction outside [1/C, C]) tells how much a rollout correction
with threshold C would truncate or mask; the sequence ratio (exp of the sum of a
sequence's token log-ratios) is what the sequence-level corrections look at.
These complement the parity metrics (exact fraction, |dlogp|, k3 KL); torch only,
fp64 sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
