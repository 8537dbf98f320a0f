"""A micro-batch's loss and metrics under layout-invariant training: token by token.

The plain path aggregates a micro-batch's loss and rescales it by the micro-batch's share of
the step's normaliser, so the gradient reaching a token carries factors of its micro-batch's
token count. Here each token's loss is its own terms times a weight that only the token's
sequence and the mini-batch's global counts define (exact integers, all-reduced before the
step):

| algorithm.loss_aggregation | weight of a valid token of sequence s |
|---|---|
| token-mean | 1 / U (U: valid tokens of the mini-batch) |
| seq-mean-token-mean | 1 / count_s / S (S: sequences with a valid token) |
| seq-mean-token-sum | 1 / S (S: all sequences) |

and the loss backpropagated is the plain sum of those products: its gradient to each token is
that token's weight exactly, whatever else the micro-batch holds. GSPO (ratio_level
'sequence') takes each sequence's mean log-ratio from its exact sum (`exact_row_means`); its
gradient still reaches each token from that token's own term. Under a rollout correction the
PPO ratio is against the pre-update logprobs, each kept token's term carries its correction
weight, dropped tokens leave the mask, and U / S / count_s count the kept tokens (S: the
sequences that keep one; `StepCorrections.units`). Every per-token term is an
elementwise function of the token's own values (torch's fp32 `exp` / `expm1` give the same bits
in their SIMD body and scalar tail: tests/kernels/test_rowwise_ops.py checks `exp`).

Metrics: each sequence's terms are summed exactly (`math.fsum` of the tokens' fp32 values) into
its own LossSums record, and the step's totals are exact sums over every sequence of every rank
(`rl_engine.exact.records.SequenceRecords`), so they do not depend on the layout either.
"""

from __future__ import annotations

import math

import torch

from rl_engine.algorithms import kl_k3, policy_loss_terms
from rl_engine.config import AlgorithmConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.policy.step_loss import Corrected, LossSums
from rl_engine.exact.records import SequenceRecords


def token_weights(mask: torch.Tensor, aggregation: str, units: float) -> torch.Tensor:
    """(b, T) fp32: each valid token's weight (module table), 0 elsewhere. `units`: the
    mini-batch's global normaliser (aggregation_units over every rank's sequences)."""
    keep = mask != 0
    inverse = torch.full(keep.shape, 1.0 / units, dtype=torch.float32, device=mask.device)
    if aggregation == "seq-mean-token-mean":
        counts = keep.sum(dim=1, keepdim=True).clamp(min=1).float()
        inverse = inverse / counts
    return torch.where(keep, inverse, 0.0)


def invariant_micro_loss(
    algo: AlgorithmConfig,
    mb: TrainBatch,
    logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    units: float,
    corrected: Corrected | None = None,
) -> tuple[torch.Tensor, SequenceRecords]:
    """(loss to backpropagate, each sequence's LossSums) of one micro-batch. `corrected`: its
    rollout correction (None under mode 'none'), whose kept mask is the loss's."""
    old, is_weights, mask = mb.rollout_logprobs, None, mb.response_mask
    if corrected is not None:
        old, is_weights = corrected.proximal, corrected.correction.weights
        mask = corrected.correction.mask
    terms = policy_loss_terms(
        logp,
        old,
        mb.advantages,
        mask,
        clip_eps=algo.clip_eps,
        clip_eps_high=algo.clip_eps_high,
        is_weights=is_weights,
        ratio_level=algo.ratio_level,
        exact_sequences=True,
    )
    scored = mb.response_mask  # the entropy and token counts: every scored token, kept or not
    weights = token_weights(mask, algo.loss_aggregation, units)
    policy = terms.per_token * weights
    kl = None
    total = policy
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp, mask=mask) * weights
        total = policy + kl * algo.kl_coef
    per_token = {
        "loss": total,
        "policy_loss": policy,
        "clipped": terms.clipped.float(),
        "kl": kl,
        "neg_logp": torch.where(scored, -logp.float(), 0.0),
        "tokens": scored.float(),
    }
    return total.sum(), sequence_records(LossSums, per_token, scored)


def sequence_records(kind, per_token: dict, mask: torch.Tensor) -> SequenceRecords:
    """One `kind` record per row of `mask`: each field the exact sum (math.fsum) of that row's
    per-token values on the mask (a None field: 0)."""
    columns = {
        name: None if values is None else values.detach().double().cpu()
        for name, values in per_token.items()
    }
    keep = mask.bool().cpu()
    records = []
    for row in range(keep.shape[0]):
        live = keep[row]
        records.append(
            kind(
                **{
                    name: 0.0 if values is None else math.fsum(values[row][live].tolist())
                    for name, values in columns.items()
                }
            )
        )
    return SequenceRecords(kind, tuple(records))
