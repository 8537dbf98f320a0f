"""Continuous batching: which requests run, in which KV-cache slot, at every step.

At most `num_slots` requests run at once, each in a slot of the cache. Every
iteration admits waiting requests into the lowest free slots and prefills them
(one forward), then decodes one token for every running request (one forward). A
request that samples EOS / a stop token or reaches `max_new_tokens` frees its slot
at once, so batch composition and cache lengths change from step to step.
Admission, release and stops depend only on the requests and their token streams,
so every rank of a tensor-parallel engine schedules alike. Which admitted requests
share a prefill (prompt_sharing.py) is the stepper's concern: it changes neither
the order of admission nor the slots.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rl_engine.rollout.completion import Request

if TYPE_CHECKING:
    from rl_engine.rollout.stepper import _Stepper

logger = logging.getLogger(__name__)


@dataclass
class GenerateStats:
    """What the last `generate` call did (for tests, logging and benchmarks)."""

    slots: int = 0
    prefill_forwards: int = 0  # forwards run (an admission whose every prompt was shared runs none)
    packed_prefills: int = 0  # prefill forwards that ran packed (see _Stepper.prefill)
    shared_prefills: int = 0  # sequences that copied another slot's prompt rows, not prefilled
    prefill_tokens: int = 0  # prompt tokens run through the model
    decode_forwards: int = 0
    admitted_while_running: int = 0  # sequences prefilled into a slot freed mid-run
    batch_sizes: list[int] = field(
        default_factory=list
    )  # running sequences of every decode forward
    seconds: float = 0.0


def run_continuous_batching(
    requests: list[Request], step: _Stepper, num_slots: int, stats: GenerateStats, bar
) -> None:
    """Generate every request to its end with `step`'s forwards, counting them in `stats`;
    `bar` (tqdm) advances by one for each finished request."""
    waiting, running, free = deque(requests), [], list(range(num_slots))
    stats.slots = num_slots
    while waiting or running:
        admitted = _admit(waiting, free)
        if admitted:
            prefill = step.prefill(admitted)
            stats.prefill_forwards += prefill.forwards
            stats.packed_prefills += prefill.packed
            stats.shared_prefills += prefill.shared
            stats.prefill_tokens += prefill.tokens
            stats.admitted_while_running += len(admitted) if running else 0
        active = running + admitted
        running = [r for r in active if not r.finished]
        if running:
            step.decode(running)
            stats.decode_forwards += 1
            stats.batch_sizes.append(len(running))
        for request in active:
            if request.finished:
                _release(request, free)
                bar.update(1)
        running = [r for r in running if not r.finished]


def _admit(waiting: deque, free: list[int]) -> list[Request]:
    """Move waiting requests into the lowest free slots (lowest first keeps batches contiguous)."""
    admitted = []
    while waiting and free:
        request = waiting.popleft()
        request.slot = heapq.heappop(free)
        admitted.append(request)
    if admitted:
        logger.debug(
            "admitted %d sequences into slots %s", len(admitted), [r.slot for r in admitted]
        )
    return admitted


def _release(request: Request, free: list[int]) -> None:
    heapq.heappush(free, request.slot)
    request.slot = -1
