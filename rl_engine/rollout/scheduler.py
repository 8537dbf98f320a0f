"""Continuous batching: which requests run, in which KV-cache slot, at every step.

At most `num_slots` requests run at once, each in a slot of the cache. Every
iteration admits waiting requests into the lowest free slots and prefills them
(one forward), then decodes one token for every running request (one forward). A
request that samples EOS / a stop token or reaches `max_new_tokens` frees its slot
at once, so batch composition and cache lengths change from step to step.
Admission, release and stops depend only on the requests and their token streams,
so every rank of a tensor-parallel engine schedules alike.

Multi-turn (`next_turn`, turns.py): a request that finishes a model turn is offered to
`next_turn`; a following request (the episode's next turn) keeps the slot and is admitted
at the next iteration, before any waiting request, in the same prefill forward as fresh
admissions and beside the running decodes: an episode whose turn ended continues at once.
None releases the slot. Which admitted requests
share a prefill (prompt_sharing.py) is the stepper's concern: it changes neither
the order of admission nor the slots.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rl_engine.rollout.completion import Request

if TYPE_CHECKING:
    from rl_engine.rollout.speculative import SpeculationCounts
    from rl_engine.rollout.stepper import Stepper

logger = logging.getLogger(__name__)


@dataclass
class GenerateStats:
    """What the last `generate` call did (for tests, logging and benchmarks)."""

    slots: int = 0
    prefill_forwards: int = 0  # forwards run (an admission whose every prompt was shared runs none)
    packed_prefills: int = 0  # prefill forwards that ran packed (see Stepper.prefill)
    shared_prefills: int = 0  # sequences that copied another slot's prompt rows, not prefilled
    prefill_tokens: int = 0  # prompt tokens run through the model
    decode_forwards: int = 0
    admitted_while_running: int = 0  # sequences prefilled into a slot freed mid-run
    continuations: int = 0  # later turns of episodes prefilled in their own slot (turns.py)
    continued_while_running: int = 0  # of those, admitted while other sequences decoded
    batch_sizes: list[int] = field(
        default_factory=list
    )  # running sequences of every decode forward
    decode_seconds: list[float] = field(default_factory=list)  # each decode forward's wall time
    seconds: float = 0.0
    speculation: SpeculationCounts | None = None  # a speculating engine's drafts (speculative/)


def run_continuous_batching(
    requests: list[Request],
    step: Stepper,
    num_slots: int,
    stats: GenerateStats,
    bar,
    next_turn: Callable[[Request], Request | None] | None = None,
) -> None:
    """Generate every request to its end with `step`'s forwards, counting them in `stats`;
    `bar` (tqdm) advances by one for each finished request. `next_turn`: called with each
    request that finishes (in slot order); the request it returns continues in that slot."""
    waiting, running, free = deque(requests), [], list(range(num_slots))
    continuing: list[Request] = []
    stats.slots = num_slots
    while waiting or running or continuing:
        admitted = continuing + _admit(waiting, free)
        if admitted:
            prefill = step.prefill(admitted)
            stats.prefill_forwards += prefill.forwards
            stats.packed_prefills += prefill.packed
            stats.shared_prefills += prefill.shared
            stats.prefill_tokens += prefill.tokens
            stats.admitted_while_running += len(admitted) - len(continuing) if running else 0
            stats.continuations += len(continuing)
            stats.continued_while_running += len(continuing) if running else 0
        active = running + admitted
        running = [r for r in active if not r.finished]
        if running:
            started = time.perf_counter()
            step.decode(running)
            stats.decode_seconds.append(time.perf_counter() - started)
            stats.decode_forwards += 1
            stats.batch_sizes.append(len(running))
        continuing = []
        for request in sorted(active, key=lambda r: r.slot):
            if request.finished:
                following = None if next_turn is None else next_turn(request)
                if following is None:
                    _release(request, free)
                    bar.update(1)
                else:
                    following.slot = request.slot  # its rows are this slot's
                    continuing.append(following)
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
