"""Exact speculative decoding: drafts verified in one forward, the tokens of plain decoding.

A decode step of plain decoding feeds each running sequence's last token (position L - 1)
and draws token L from that row's logprobs with `token_uniform(key, index)`. Here each
sequence's row is its last token followed by up to k drafts d_1..d_m (positions L - 1 ..
L - 1 + m), run through the policy in ONE forward. Every op is row-invariant and the
attention reduces each query over its own positions in an order set by the position alone,
so column i's logprobs have the bits a decode step at that position would give once the
tokens before it are the ones plain decoding drew. Walking the columns in order:

    draw t_i from column i with the uniform of its own index (position-keyed);
    t_i is emitted (Request.append: stop tokens and the max_new_tokens cut apply as always);
    continue only while the sequence runs and t_i == d_{i+1}.

So every emitted token is drawn from the logprob row plain decoding computes, with the
uniform plain decoding uses: tokens and logprobs are `torch.equal` to it, whatever the
drafts (they decide only how many tokens one forward emits). Columns after the first
mismatch are thrown away; the keys and values they wrote sit past the sequence's length,
where no query reads them, and the next forward overwrites them (kv_cache.py). A call-order
random stream would break this: the draws of thrown-away columns would shift every later
token (tests/rollout/test_speculative.py shows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rl_engine.rollout.completion import Request
from rl_engine.rollout.sampling import sample_token, token_uniform
from rl_engine.rollout.speculative.params import SpeculativeParams
from rl_engine.rollout.stepper import padded_rows

if TYPE_CHECKING:
    from rl_engine.rollout.stepper import Stepper


@dataclass
class SpeculationCounts:
    """What speculation did in one generate call."""

    forwards: int = 0  # verifying forwards (the decode steps of at most max_batch sequences)
    rows: int = 0  # sequences those forwards verified (one row each)
    proposed: int = 0  # draft tokens fed to the policy
    accepted: int = 0  # drafts equal to the token drawn at their position
    emitted: int = 0  # tokens the verifying forwards appended

    def add(self, other: SpeculationCounts) -> None:
        for name in ("forwards", "rows", "proposed", "accepted", "emitted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed drafts (0.0 when none was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a sequence gains per verifying forward (1.0 = plain decoding's rate)."""
        return self.emitted / self.rows if self.rows else 0.0


class SpeculativeDecode:
    """A Stepper's decode step with drafts: propose, verify in one forward, emit."""

    def __init__(self, stepper: Stepper, params: SpeculativeParams, proposer):
        self.stepper, self.params, self.proposer = stepper, params, proposer
        self.counts = SpeculationCounts()
        # drafts each request may propose next: after a rejection, one more than it had
        # accepted (a rejected draft cost a position for nothing); after a full accept, k
        self.allowance: dict[int, int] = {}

    def applies(self, requests: list[Request]) -> bool:
        """Whether this decode step speculates (`max_batch`); else it decodes one token each,
        the same bits either way."""
        return len(requests) <= self.params.max_batch

    def decode(self, requests: list[Request]) -> None:
        """One verifying forward for every running request (sorted by slot)."""
        sampling = self.stepper.sampling
        k = self.params.num_tokens
        budgets = [min(self.allowance.get(r.key, k), _left(r, sampling) - 1) for r in requests]
        drafts = [
            _until_stop(d[:b], sampling)
            for d, b in zip(self.proposer.propose(requests, budgets), budgets)
        ]
        rows = [[r.token_ids[-1], *d] for r, d in zip(requests, drafts)]
        ids, positions = padded_rows(rows, [r.length - 1 for r in requests])
        width = ids.shape[1]
        logp = self.stepper.score_rows(requests, ids, positions)  # (N, V) row-major; None
        walked = None if logp is None else self._walk(requests, drafts, logp.cpu())
        # a tensor-parallel engine's rank 0 walks; every rank appends the same tokens
        for request, draft, (tokens, values) in zip(
            requests, drafts, self.stepper.share_walk(walked, len(requests), width)
        ):
            for token, value in zip(tokens, values):
                request.append(token, value, sampling)
            accepted = sum(d == t for d, t in zip(draft, tokens))
            self._count(draft, tokens, accepted)
            self._adapt(request, draft, accepted)
        self.counts.forwards += 1
        self.counts.rows += len(requests)

    def _walk(self, requests, drafts, logp: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """Per request: the tokens plain decoding draws at its row's positions, and their
        logprobs, up to and including the first that is not the next draft or that ends it."""
        sampling, walked, start = self.stepper.sampling, [], 0
        for request, draft in zip(requests, drafts):
            rows, tokens, values = logp[start : start + len(draft) + 1], [], []
            for column, row in enumerate(rows):
                index = len(request.token_ids) + column
                token = sample_token(row, sampling, token_uniform(request.key, index))
                tokens.append(token)
                values.append(float(row[token]))
                ends = sampling.stops_on(token) or _left(request, sampling) == column + 1
                if ends or column == len(draft) or token != draft[column]:
                    break
            walked.append((tokens, values))
            start += len(draft) + 1
        return walked

    def _adapt(self, request: Request, draft: list[int], accepted: int) -> None:
        """The request's next allowance: k after every draft was accepted (or none was
        proposed), else one more than it accepted now."""
        if request.finished:
            self.allowance.pop(request.key, None)
            return
        full = accepted == len(draft)
        self.allowance[request.key] = self.params.num_tokens if full else accepted + 1

    def _count(self, draft: list[int], tokens: list[int], accepted: int) -> None:
        self.counts.proposed += len(draft)
        self.counts.accepted += accepted
        self.counts.emitted += len(tokens)


def _until_stop(drafts: list[int], sampling) -> list[int]:
    """The drafts up to and including the first that would end the request: nothing after
    it could be emitted."""
    for index, token in enumerate(drafts):
        if sampling.stops_on(token):
            return drafts[: index + 1]
    return drafts


def _left(request: Request, sampling) -> int:
    """Tokens the request may still sample."""
    return (request.max_new_tokens or sampling.max_new_tokens) - len(request.token_ids)
