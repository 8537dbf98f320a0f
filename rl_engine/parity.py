"""Mismatch between two sets of per-token logprobs (trainer vs. rollout): the one definition.

Both the worker's `parity/*` step metrics and the diagnostics' report come from
`parity_sums`, a vector of sums that adds up over micro-batches and ranks
(`merge_sums`, `reduce_sums`) and turns into metrics at the end.

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
`correction_sums` / `correction_metrics` are the worker's `correction/*` step
metrics (what the rollout correction truncated or dropped), summed over
micro-batches and ranks like `parity_sums`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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

STEP_SUMS = (
    "tokens",
    "truncated",
    "dropped",
    "ratio_sum",
    "ratio_max",
    "neg_ratio_min",
    "k3_sum",
    "trainer_logp_sum",
    "rollout_logp_sum",
    "sequences",
    "dropped_sequences",
)
_MAX_SUMS = (STEP_SUMS.index("ratio_max"), STEP_SUMS.index("neg_ratio_min"))


def correction_sums(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, correction):
    """(len(STEP_SUMS),) fp64 sums of one micro-batch: add them up (max for the *_max / neg_*_min).

    trainer / rollout / mask: (B, T); `correction`: the RolloutCorrection applied to them.
    """
    valid = mask.bool()
    if not bool(valid.any()):
        return empty_correction_sums()
    a, b = trainer.detach().double()[valid], rollout.double()[valid]
    ratio = torch.exp(a - b)
    has_tokens = valid.any(dim=1)
    dropped_rows = has_tokens & ~correction.mask.any(dim=1)
    values = [
        valid.sum(),
        correction.truncated.sum(),
        correction.dropped.sum(),
        ratio.sum(),
        ratio.max(),
        -ratio.min(),
        kl_k3(rollout, trainer.detach(), mask=valid).double().sum(),  # KL(rollout || trainer)
        a.sum(),
        b.sum(),
        has_tokens.sum(),
        dropped_rows.sum(),
    ]
    return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values]).cpu()


def merge_correction_sums(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    merged = total + part
    for i in _MAX_SUMS:
        merged[i] = torch.maximum(total[i], part[i])
    return merged


def reduce_correction_sums(sums: torch.Tensor, all_reduce) -> torch.Tensor:
    """Over ranks: `all_reduce(tensor, "sum" | "max")` returns the reduced copy."""
    summed = all_reduce(sums, "sum")
    idx = list(_MAX_SUMS)
    summed[idx] = all_reduce(sums[idx].clone(), "max")
    return summed


def empty_correction_sums() -> torch.Tensor:
    sums = torch.zeros(len(STEP_SUMS), dtype=torch.float64)
    sums[list(_MAX_SUMS)] = -float("inf")
    return sums


def correction_metrics(sums: torch.Tensor) -> dict[str, float]:
    """`correction/*` metrics of a step: ratio stats, fractions truncated / masked, k3 KL, perplexities."""
    s = dict(zip(STEP_SUMS, sums.tolist()))
    tokens = max(s["tokens"], 1.0)
    return {
        "correction/ratio_mean": s["ratio_sum"] / tokens,
        "correction/ratio_min": -s["neg_ratio_min"],
        "correction/ratio_max": s["ratio_max"],
        "correction/truncated_fraction": s["truncated"] / tokens,
        "correction/masked_fraction": s["dropped"] / tokens,
        "correction/masked_sequence_fraction": s["dropped_sequences"] / max(s["sequences"], 1.0),
        "correction/k3_kl": s["k3_sum"] / tokens,
        "correction/trainer_ppl": _exp(-s["trainer_logp_sum"] / tokens),
        "correction/rollout_ppl": _exp(-s["rollout_logp_sum"] / tokens),
    }


def _exp(x: float) -> float:
    """math.exp, inf instead of OverflowError (a non-finite loss step still reports its metrics)."""
    return math.inf if x > 709.0 else math.exp(x)
