"""`TurnSession`: sequences that stay in their KV-cache slots between a model's turns.

A multi-turn episode's next turn continues its transcript. The session keeps each sequence
(by the caller's key) in one slot of its own cache across `generate` calls; a call's prompt is
the whole transcript, and only the tokens after what the slot holds (the last sampled token,
which no forward has fed yet, and the observation) run, by a prefill that starts at the slot's
length: q_positions L..L+M-1 reading the earlier keys through kv_index. New keys, and
transcripts that do not extend what their slot holds, prefill from position 0 in the same
forward; then every sequence of the call decodes in the same batch.

Exactness: the invariant attention gives a prefill at an offset the bits of a full prefill
and of decode (tests/kernels/test_prefill_at_offset.py, every backend), and every other op is
row-wise, so a session's turn is token for token `engine.generate(transcripts, sampling)` with
n = 1: the same generator per request (seed, index in the call, 0), the same stopping and the
same logprobs. A cache holds one weight version's keys: a call after a weight change raises.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from rl_engine.rollout.checks import check_prompts, check_sampling
from rl_engine.rollout.completion import Completion, Request
from rl_engine.rollout.sampling import SamplingParams, request_generator
from rl_engine.rollout.scheduler import GenerateStats
from rl_engine.rollout.stepper import PAD_ID

if TYPE_CHECKING:
    from rl_engine.rollout.engine import RolloutEngine


class TurnSession:
    """`num_slots` sequences of at most `capacity` tokens kept across turns (module docstring);
    made by `RolloutEngine.turn_session`."""

    def __init__(self, engine: RolloutEngine, num_slots: int, capacity: int):
        for name, value in (("num_slots", num_slots), ("capacity", capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.engine, self.num_slots = engine, num_slots
        self.cache = engine._make_cache(num_slots, capacity)
        self.capacity = capacity
        self.weight_version = engine.weight_version
        self._held: dict[Hashable, tuple[int, list[int]]] = {}  # key -> (slot, ids in its rows)

    def generate(
        self, prompts: Sequence[tuple[Hashable, Sequence[int]]], sampling: SamplingParams
    ) -> list[Completion]:
        """One turn of (key, whole transcript) pairs, in order: `generate(transcripts,
        sampling)` token for token (sampling.n must be 1). Keys held by the session but not
        in this call have ended: their slots are freed."""
        requests, cached = self._requests(prompts, sampling)
        self.engine.last_stats = stats = GenerateStats(slots=self.num_slots)
        start = time.perf_counter()
        with torch.inference_mode(), self.engine._attention_mode():
            step = self.engine._make_stepper(self.cache, sampling)
            stats.prefill_tokens = self._prefill(step, requests, cached)
            stats.prefill_forwards = 1
            running = [r for r in requests if not r.finished]
            while running:
                step.decode(running)
                stats.decode_forwards += 1
                stats.batch_sizes.append(len(running))
                running = [r for r in running if not r.finished]
        stats.seconds = time.perf_counter() - start
        for (key, _), r in zip(prompts, requests):
            self._held[key] = (r.slot, r.prompt_ids + r.token_ids[:-1])  # the last: never fed
        return [r.completion(self.weight_version, sampling.logprob_temperature) for r in requests]

    def _requests(self, prompts, sampling) -> tuple[list[Request], list[int]]:
        """The call's requests in their slots, and how many leading ids each slot already
        holds (0: prefill from the start)."""
        self.engine._check_weights_complete()
        if self.engine.weight_version != self.weight_version:
            raise RuntimeError(
                f"the session's cache holds keys of weight version {self.weight_version}, but "
                f"the engine now has {self.engine.weight_version}: open a new turn_session"
            )
        sampling = check_sampling(sampling)
        if sampling.n != 1:
            raise ValueError(f"a turn session samples one completion per key, got n={sampling.n}")
        keys = [key for key, _ in prompts]
        if len(set(keys)) != len(keys):
            raise ValueError("a turn session's keys must be distinct within a call")
        ids = check_prompts(
            [p for _, p in prompts],
            vocab_size=self.engine.vocab_size,
            max_seq_len=min(self.engine.max_seq_len, self.capacity),
            max_new_tokens=sampling.max_new_tokens,
        )
        self._held = {k: held for k, held in self._held.items() if k in set(keys)}
        free = sorted(set(range(self.num_slots)) - {slot for slot, _ in self._held.values()})
        if len(keys) - len(self._held) > len(free):
            raise ValueError(
                f"a turn of {len(keys)} sequences needs more than the session's "
                f"{self.num_slots} slots"
            )
        requests, cached = [], []
        for p, (key, transcript) in enumerate(zip(keys, ids)):
            slot, held = self._held.get(key) or (free.pop(0), [])
            extends = len(held) < len(transcript) and transcript[: len(held)] == held
            cached.append(len(held) if extends else 0)
            request = Request(p, 0, transcript, request_generator(sampling.seed, p, 0))
            request.slot, request.shares_prefill = slot, False
            requests.append(request)
        return requests, cached

    def _prefill(self, step, requests: list[Request], cached: list[int]) -> int:
        """One right-padded forward of each request's ids after what its slot holds, at their
        positions (a prefill at an offset, or from 0), that samples each first token; returns
        the tokens it ran."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].slot)
        rows = [requests[i].prompt_ids[cached[i] :] for i in order]
        ids = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.long)
        positions = torch.full(ids.shape, -1, dtype=torch.long)
        for row, i in enumerate(order):
            ids[row, : len(rows[row])] = torch.tensor(rows[row])
            positions[row, : len(rows[row])] = torch.arange(cached[i], len(requests[i].prompt_ids))
        last = torch.tensor([len(r) - 1 for r in rows])
        batch = [requests[i] for i in order]
        step._sample(batch, step._score(batch, ids, positions, last))
        return sum(map(len, rows))
