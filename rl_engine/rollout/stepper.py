"""The forwards of one `generate` call: prefill or decode a batch of requests, score, sample.

A prefill runs the prompts of newly admitted requests, right-padded or, when the
engine says so, packed into one row with segment-aware attention; with the engine's
`share_prompt_prefill`, one request per prompt runs and the others copy its KV rows and
its logprob row (prompt_sharing.py); a decode feeds every running request's last token
(one query each). Both write the KV cache through the attention hook (`rl_kv_cache`) or,
for the padded and decode forwards of a patched dense model, through its FastDecoder: the
same ops in the same order without transformers' module calls (patching/decode_path.py),
its GEMMs on the weights packed at the start of the call into the engine's
`packed_weights` (patching/packed_weights.py).
Each row's last hidden state is scored: patched, through the `lm_head` and `log_softmax`
ops the model was patched with (`model_op`), the definition the trainer's `linear_logp`
computes, so every recorded logprob equals its recompute bit for bit; unpatched, through
the model's own lm_head and `torch.log_softmax`. Each row then draws its token with the
uniform of its own position, `token_uniform(request.key, len(request.token_ids))`
(`sample_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rl_engine.patching import (
    KV_CACHE_KWARG,
    PACKED_KWARG,
    PackedSegments,
    fast_decoder,
    lm_head_parameters,
    model_op,
)
from rl_engine.rollout.completion import Request
from rl_engine.rollout.kv_cache import SlotKVCache
from rl_engine.rollout.prompt_sharing import PromptSharing, SharePlan
from rl_engine.rollout.sampling import SamplingParams, sample_token, token_uniform

PAD_ID = 0  # fills the right padding of a ragged prefill; never attended to, never scored

# A patched engine packs a prefill into one row when the padded batch would compute more
# than this many times its real tokens (measured: docs/benchmarks.md, "Rollout prefill").
PACK_PREFILL = 1.25


class StepperEngine(Protocol):
    """What a Stepper reads of its engine (a RolloutEngine or a tensor-parallel one)."""

    model: nn.Module
    device: torch.device
    batch_invariant: bool
    share_prompt_prefill: bool
    packed_weights: object


def padded_rows(rows: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, positions) (B, longest row): row b's tokens right-padded with PAD_ID, at positions
    starts[b], starts[b] + 1, ...; -1 marks padding."""
    ids = torch.full((len(rows), max(len(row) for row in rows)), PAD_ID, dtype=torch.long)
    positions = torch.full(ids.shape, -1, dtype=torch.long)
    for index, (row, start) in enumerate(zip(rows, starts)):
        ids[index, : len(row)] = torch.tensor(row)
        positions[index, : len(row)] = torch.arange(start, start + len(row))
    return ids, positions


def packs_prefill(batch_invariant: bool, lengths: list[int]) -> bool:
    """Whether a prefill of prompts of these lengths runs packed into one row: patched
    (the packed attention is the invariant op's) and padding would compute more than
    PACK_PREFILL times the real tokens."""
    return batch_invariant and len(lengths) * max(lengths) > PACK_PREFILL * sum(lengths)


@dataclass(frozen=True)
class PrefillOutcome:
    """What one admission's prefill did (counted in GenerateStats)."""

    forwards: int  # 0 (every admitted request copied a live slot's prompt) or 1
    packed: bool  # the forward ran packed
    shared: int  # requests that copied another slot's prompt rows instead of prefilling
    tokens: int  # prompt tokens run through the model


class Stepper:
    """One generate call's forwards: prefill / decode a batch of requests, score, sample."""

    def __init__(self, engine: StepperEngine, cache: SlotKVCache, sampling: SamplingParams):
        self.engine, self.model, self.cache, self.sampling = engine, engine.model, cache, sampling
        self.device = engine.device
        self.temperature = sampling.logprob_temperature
        self.sharing = PromptSharing(engine.share_prompt_prefill)
        self._decoder = None  # the module path; patched dense models: the same ops, flat
        self.speculation = None  # a SpeculativeDecode: decode steps verify drafts (speculative/)
        if engine.batch_invariant:
            decoder = fast_decoder(self.model)
            if decoder is not None:  # its GEMM weights packed now, for this call
                self._decoder = decoder.packed_into(engine.packed_weights)
            self._lm_head = model_op(self.model, "lm_head")
            self._log_softmax = model_op(self.model, "log_softmax")
            self._head_params = lm_head_parameters(self.model)

    def prefill(self, requests: list[Request]) -> PrefillOutcome:
        """Give newly admitted requests their prompt's KV rows and sample their first token:
        the prompts the sharing plan runs go through one forward (`_prefill_forward`), the
        other requests copy a slot's rows; each draws from its prompt's logprob row."""
        requests = sorted(requests, key=lambda r: r.slot)
        plan = self.sharing.plan(requests)
        logp, packed = self._prefill_forward(plan.run) if plan.run else (None, False)
        self._copy_prompt_rows(plan)
        self._sample(requests, self.sharing.first_logprobs(requests, plan, logp))
        tokens = sum(len(r.prompt_ids) - r.cached for r in plan.run)
        return PrefillOutcome(int(bool(plan.run)), packed, len(plan.copies), tokens)

    def _prefill_forward(self, requests: list[Request]) -> tuple[torch.Tensor | None, bool]:
        """((B, V) logprobs at each prompt's last position (None on a rank that does not
        score), whether it ran packed): packed into one row (`_packed_prefill`) when the
        engine packs prompts of these lengths and none continues in its slot, else
        right-padded, each row from the first id its slot does not hold (`Request.cached`):
        a continued episode's prefill at an offset reads its earlier keys from the cache
        (the attention's kv_index), a fresh prompt's starts at 0, in the same forward."""
        lengths = [len(r.prompt_ids) - r.cached for r in requests]
        continues = any(r.cached for r in requests)
        if not continues and packs_prefill(self.engine.batch_invariant, lengths):
            return self._packed_prefill(requests), True
        ids, positions = padded_rows(
            [r.prompt_ids[r.cached :] for r in requests], [r.cached for r in requests]
        )
        last = torch.tensor(lengths) - 1  # (B,)
        return self.score(requests, ids, positions, last), False

    def _packed_prefill(self, requests: list[Request]) -> torch.Tensor | None:
        """The prompts concatenated in one row (positions restarting at 0): segment-aware
        attention on the row's own keys, which the cache stores for decoding (`bind_packed`).
        Every token gets the bits of the padded prefill (the invariant ops are row-wise)."""
        lengths = [len(r.prompt_ids) for r in requests]
        ids = torch.tensor([[t for r in requests for t in r.prompt_ids]], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(self.device)  # (1, N)
        segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        token_slots = torch.cat([torch.full((n,), r.slot) for r, n in zip(requests, lengths)])[None]
        last = torch.tensor(lengths).cumsum(0) - 1  # (B,) column of each prompt's last token
        packed = PackedSegments(positions, segments.to(self.device))
        self.cache.bind_packed(token_slots.to(self.device), positions)
        hidden = self._forward(ids, positions, **{PACKED_KWARG: packed})  # (1, N, H)
        return self._logprobs(hidden[0, last.to(self.device)])

    def _copy_prompt_rows(self, plan: SharePlan) -> None:
        """Each copying request's prompt rows from its source slot (grouped by source)."""
        by_source: dict[tuple[int, int], list[int]] = {}
        for request, source in plan.copies:
            by_source.setdefault((source, len(request.prompt_ids)), []).append(request.slot)
        for (source, length), targets in by_source.items():
            self.cache.copy_rows(source, targets, length)

    def decode(self, requests: list[Request]) -> None:
        """Feed every request's last sampled token (one query each) and sample the next; a
        speculating engine's small batches verify drafts after it in the same forward."""
        requests = sorted(requests, key=lambda r: r.slot)
        if self.speculation is not None and self.speculation.applies(requests):
            self.speculation.decode(requests)
            return
        ids = torch.tensor([[r.token_ids[-1]] for r in requests])  # (B, 1)
        positions = torch.tensor([[r.length - 1] for r in requests])  # (B, 1)
        self._step(requests, ids, positions, torch.zeros(len(requests), dtype=torch.long))

    def _step(self, requests, ids, positions, last) -> None:
        self._sample(requests, self.score(requests, ids, positions, last))

    def score(self, requests, ids, positions, last) -> torch.Tensor | None:
        """(B, V) logprobs of each row's token at column `last` (None on a rank that does not
        score), after one forward that writes the requests' slots."""
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        hidden = self._last_hidden(
            ids.to(self.device), positions.to(self.device), last.to(self.device), slots
        )
        return self._logprobs(hidden)

    def score_rows(self, requests, ids, positions) -> torch.Tensor | None:
        """(N, V) logprobs of every real cell (position >= 0) of ids (B, T), row by row, after
        one forward that writes the requests' slots (a verifying forward: verify.py); None on
        a rank that does not score."""
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        positions = positions.to(self.device)
        self.cache.bind(slots, positions)
        hidden = self._forward(ids.to(self.device), positions.clamp(min=0))  # (B, T, H)
        return self._logprobs(hidden[positions >= 0])

    def share_walk(self, walked, requests: int, width: int):
        """A verifying forward's emitted (tokens, logprobs) per request, on every process of
        the engine (one process: as given; a tensor-parallel stepper broadcasts rank 0's)."""
        return walked

    def _last_hidden(self, ids, positions, last, slots) -> torch.Tensor:
        """(B, H) final-norm hidden state of each row's token at column `last`."""
        self.cache.bind(slots, positions)
        hidden = self._forward(ids, positions.clamp(min=0))  # (B, T, H)
        rows = torch.arange(ids.shape[0], device=ids.device)
        return hidden[rows, last]  # (B, H)

    def _forward(self, ids, positions, **kwargs) -> torch.Tensor:
        """(B, T, H) final-norm hidden states of one decoder forward that reads and writes
        the cache as bound; unbinds it, whatever happens. A padded or decode forward of a
        patched dense model runs its FastDecoder (the modules' ops in their order, without
        HF's module calls); a packed one, and any other model, the modules."""
        try:
            if self._decoder is not None and not kwargs:
                real = None if ids.shape[1] == 1 else self.cache.bound()[1] >= 0
                return self._decoder(ids, positions, self.cache, real)
            out = self.model.base_model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                **{KV_CACHE_KWARG: self.cache},
                **kwargs,
            )
        finally:
            self.cache.unbind()
        return out.last_hidden_state

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B, V) fp32 log softmax(logits / T) over the full vocabulary."""
        if self._decoder is not None:  # the same op, on its packed weight where it packs
            return self._scaled_log_softmax(self._decoder.lm_head(hidden))
        if self.engine.batch_invariant:
            weight, bias = self._head_params
            return self._scaled_log_softmax(self._lm_head(hidden, weight, bias))
        logits = self.model.get_output_embeddings()(hidden).float()  # (B, V)
        return self._scaled_log_softmax(logits)

    def _scaled_log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of the whole vocabulary -> fp32 log softmax(logits / T): the patched
        model's op, or plain torch."""
        if self.engine.batch_invariant:
            return self._log_softmax(logits, self.temperature)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return torch.log_softmax(logits, dim=-1)

    def _sample(self, requests: list[Request], logp: torch.Tensor) -> None:
        self._append(requests, *self._choose(requests, logp))

    def _choose(self, requests: list[Request], logp: torch.Tensor) -> tuple[list[int], list[float]]:
        """Each row's sampled token and its logprob (row r of logp is requests[r])."""
        logp_cpu = logp.cpu()
        tokens = [
            sample_token(logp_cpu[row], self.sampling, _next_uniform(request))
            for row, request in enumerate(requests)
        ]
        rows = torch.arange(len(requests))
        return tokens, logp_cpu[rows, torch.tensor(tokens)].tolist()

    def _append(self, requests: list[Request], tokens: list[int], logprobs: list[float]) -> None:
        for request, token, logprob in zip(requests, tokens, logprobs):
            request.append(token, logprob, self.sampling)


def _next_uniform(request: Request) -> float:
    """The uniform of the request's next token: keyed by its position in the completion, so
    it is the same whatever was drawn before it, by this request or any other."""
    return token_uniform(request.key, len(request.token_ids))
