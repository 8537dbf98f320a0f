"""One prefill per prompt: which admitted requests run their prompt through the model, and
which copy the KV rows of a slot that already holds it.

The samples of one prompt (`SamplingParams.n`, a step's samples_per_prompt) and identical
prompts across groups need the same keys and values at every prompt position and the same
logprob row at the prompt's last position. With a patched model a prefill is batch-invariant
(a token's bits depend on its own sequence alone, padded or packed, whatever else is in the
batch), so the prompt run once gives every sample the bits its own prefill would give:

- the first request of each prompt in an admission (its lowest slot) is prefilled;
- every other request of that prompt copies its rows (`SlotKVCache.copy_rows`) and draws its
  first token, with its own key, from the same logprob row;
- a request admitted later, once a slot frees, copies from a live slot of the same `generate`
  call that holds its prompt (a running sequence's prompt rows are never rewritten: decode
  writes past them), with the logprob row kept while such a slot lives; else it prefills.

Admission order and slots stay the scheduler's. An unpatched model shares too, but there a
prefill's bits depend on its batch, so sharing may change them (invariance off makes no
bitwise promise).

Copy at admission, not shared pages: the attention op reads each slot's keys in place (slot
position == sequence position, `kv_index`), so every slot holds its own rows, and a page table
would be a change to the op. A copy moves 2 x layers x Hkv x D x prompt-length values per
sample, against the prefill's ~2 x parameters FLOPs per prompt token.

What shares: requests with the same `Request.share_key`, the full token list a request
prefills at admission. A prefill that continues a transcript after an environment turn
(multi-turn) must never share, since a group's transcripts diverge: `generate(...,
after_env_turn=True)` builds its requests with `shares_prefill=False` (key None), and each
prefills on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.rollout.completion import Request


@dataclass(frozen=True)
class SharePlan:
    """How one admission prefills: `run` (slot order) goes through the model; each of `copies`
    is (request, the slot whose prompt rows it copies)."""

    run: list[Request]
    copies: list[tuple[Request, int]]


@dataclass
class _Held:
    """A prompt held by live slots: the requests holding its rows and its first-token row."""

    holders: list[Request]
    logp: torch.Tensor | None  # (V,) fp32; None on a tensor-parallel rank that does not sample


class PromptSharing:
    """Which live slot holds which prompt, during one `generate` call. `enabled=False`: every
    request prefills on its own (today's per-sample prefill)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._held: dict[tuple[int, ...], _Held] = {}

    def plan(self, admitted: list[Request]) -> SharePlan:
        """Split an admission (sorted by slot) into the requests to prefill and the copies."""
        self._forget_released()
        run, copies, leaders = [], [], {}
        for request in admitted:
            key = request.share_key if self.enabled else None
            if key is None:
                run.append(request)
            elif key in self._held:
                copies.append((request, self._held[key].holders[0].slot))
            elif key in leaders:
                copies.append((request, leaders[key].slot))
            else:
                leaders[key] = request
                run.append(request)
        return SharePlan(run, copies)

    def first_logprobs(
        self, admitted: list[Request], plan: SharePlan, logp: torch.Tensor | None
    ) -> torch.Tensor | None:
        """(len(admitted), V) fp32: the logprob row each admitted request draws its first token
        from; `logp` (len(plan.run), V) is the prefill's. Records the admitted requests as
        holders of their prompts. None where the rows are None (a tensor-parallel rank that
        does not sample)."""
        if not self.enabled:
            return logp  # every admitted request ran, in this order
        rows = {id(r): None if logp is None else logp[i] for i, r in enumerate(plan.run)}
        for request in admitted:
            key = request.share_key if self.enabled else None
            if key is None:
                continue
            held = self._held.get(key)
            if held is None:
                row = rows[id(request)]  # a leader: the first of its prompt
                held = self._held[key] = _Held([], None if row is None else row.clone())
            held.holders.append(request)
            rows[id(request)] = held.logp
        picked = [rows[id(r)] for r in admitted]
        if any(row is None for row in picked):
            return None
        return torch.stack(picked)

    def _forget_released(self) -> None:
        """Drop the holders whose slots were released, and the prompts no live slot holds."""
        for key in list(self._held):
            held = self._held[key]
            held.holders = [r for r in held.holders if r.slot >= 0 and not r.finished]
            if not held.holders:
                del self._held[key]
