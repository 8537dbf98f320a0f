"""Who proposes the drafts: prompt lookup, or a draft model with a KV cache of its own.

A proposer's `propose(requests, budgets)` returns, for each running request (sorted by
slot), up to budgets[i] draft tokens for its next positions. Drafts never change a token
or a logprob (verify.py); they only decide how many tokens a forward emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rl_engine.patching.packed_weights import PackedWeights
from rl_engine.rollout.completion import Request
from rl_engine.rollout.sampling import SamplingParams, sample_token, token_uniform
from rl_engine.rollout.speculative.ngram import propose_ngram
from rl_engine.rollout.speculative.params import SpeculativeParams
from rl_engine.rollout.stepper import padded_rows


class NgramProposer:
    """Prompt lookup over each request's prompt and completion so far."""

    def __init__(self, params: SpeculativeParams):
        self.params = params

    def propose(self, requests: list[Request], budgets: list[int]) -> list[list[int]]:
        p = self.params
        return [
            propose_ngram(r.prompt_ids + r.token_ids, b, p.ngram_max, p.ngram_min) if b > 0 else []
            for r, b in zip(requests, budgets)
        ]


@dataclass
class DraftEngine:
    """What a Stepper reads of an engine, for the draft model; `packed_weights` is the
    engine's own store (one store holds the policy's and the draft's packed weights, kept
    and released with the engine's)."""

    model: nn.Module
    device: torch.device
    batch_invariant: bool
    packed_weights: PackedWeights
    share_prompt_prefill: bool = False


class DraftProposer:
    """A draft causal LM in a KV cache of its own (same slots, same capacity as the policy's).

    Each draft is drawn from the draft's logprobs with the uniform of the position it
    proposes for (`token_uniform(key, index)`), as the policy will draw it: where the two
    distributions agree the draws agree, so a draft equal to the policy accepts everything,
    at any temperature. A slot remembers the tokens whose keys and values its cache holds;
    a proposal first feeds the request's tokens past their common prefix (a new request
    re-uses a finished one's prompt rows when the prompts agree), then one token at a time.
    """

    def __init__(self, stepper, params: SpeculativeParams):
        self.stepper, self.params = stepper, params
        self.held: dict[int, list[int]] = {}  # slot -> tokens at positions 0.. in its cache

    def propose(self, requests: list[Request], budgets: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, b in enumerate(budgets) if b > 0]
        stops = self.stepper.sampling.stops_on
        for step in range(max((budgets[i] for i in active), default=0)):
            # a request's drafts end at its budget or at a draft that would end it
            active = [i for i in active if budgets[i] > step and not _ends(drafts[i], stops)]
            if not active:
                break
            rows = [self._feed(requests[i], drafts[i]) for i in active]
            self._draw([requests[i] for i in active], rows, [drafts[i] for i in active])
        return drafts

    def _feed(self, request: Request, drafts: list[int]) -> tuple[list[int], int]:
        """(tokens to run, position of the first) so that the slot's cache holds the request's
        tokens and drafts so far, but the last."""
        sequence = request.prompt_ids + request.token_ids + drafts
        held = self.held.get(request.slot, [])
        common = _common_prefix(held, sequence[:-1])
        self.held[request.slot] = sequence
        return sequence[common:], common

    def _draw(self, requests, rows, drafts) -> None:
        ids, positions = padded_rows([tokens for tokens, _ in rows], [first for _, first in rows])
        last = torch.tensor([len(tokens) - 1 for tokens, _ in rows])
        logp = self.stepper.score(requests, ids, positions, last).cpu()  # (B, V)
        sampling: SamplingParams = self.stepper.sampling
        for row, (request, proposed) in enumerate(zip(requests, drafts)):
            index = len(request.token_ids) + len(proposed)
            proposed.append(sample_token(logp[row], sampling, token_uniform(request.key, index)))


def _ends(drafts: list[int], stops_on) -> bool:
    return bool(drafts) and stops_on(drafts[-1])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
