"""Multi-turn episodes in the continuous-batching loop: each model turn is a request, and the
next turn continues in the same KV slot (`RolloutEngine.generate_episodes`).

An episode starts as a `TurnStart` (its prompt, its episode index, its turn number). When a
turn ends (EOS / a stop token / its token budget) the caller's `on_turn_end(index, turn)` sees
the turn as a `Completion` (prompt_ids: the transcript before it) and answers with a
`Continuation` or None (the episode is over; its slot is freed). A continuation's transcript
is the one before + the turn's first `kept` tokens + the observation; it keeps its slot, whose
rows already hold everything up to the turn's last sampled token (which no forward has fed
yet), and is admitted at the scheduler's next iteration: a prefill at the slot's length of
[that last token, the observation], in the same forward as fresh admissions and beside the
running decodes (scheduler.py, stepper.py). A turn cut short (`kept` < the turn's length) is
prefilled from the cut: the rows past it are rewritten.

Seeds: every turn draws with the key of (sampling.seed, episode, turn) (`turn_key`; token i of
the turn uses `token_uniform(key, i)`), so its tokens depend on nothing about scheduling, slot
count or engine count. A turn's budget is `turn_budget`: sampling.max_new_tokens, within what
is left of `max_total_tokens`, the capacity of every slot. First turns (turn 1) may share their
prompt's prefill (prompt_sharing.py); a later turn never does.

Exactness: the invariant attention gives a prefill at an offset the bits of a full prefill and
of decode (tests/kernels/test_prefill_at_offset.py), and every other op is row-wise, so every
sampled token's logprob equals the trainer's teacher-forced recompute of the whole transcript,
whatever ran beside it; and an episode continued in its slot is token for token the same
episode with each turn's whole transcript sent as a fresh `TurnStart`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rl_engine.base.fields import is_int
from rl_engine.rollout.completion import Completion, Request
from rl_engine.rollout.sampling import SamplingParams, turn_key


@dataclass(frozen=True)
class TurnStart:
    """The first model turn an engine call plays of an episode: its whole transcript so far,
    its episode index and turn number (from 1), which seed its draws."""

    prompt_ids: Sequence[int]
    episode: int
    turn: int = 1


@dataclass(frozen=True)
class Continuation:
    """The next model turn of an episode: the observation's ids appended after the turn's
    first `kept` tokens (None: all of them), and the next turn's budget of sampled tokens."""

    observation_ids: Sequence[int]
    max_new_tokens: int
    kept: int | None = None


# (index of the episode's TurnStart, the turn that ended) -> the next turn, or None: it is over
OnTurnEnd = Callable[[int, Completion], Continuation | None]


def turn_budget(max_new_tokens: int, length: int, max_total_tokens: int) -> int:
    """The sampled tokens a turn may take after a transcript of `length` ids: max_new_tokens,
    within max_total_tokens."""
    return min(max_new_tokens, max_total_tokens - length)


class TurnChain:
    """The requests of one `generate_episodes` call: each episode's first turn, and each next
    turn its `on_turn_end` asks for (`next_turn`, the scheduler's hook)."""

    def __init__(
        self,
        episodes: list[tuple[int, int]],
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        on_turn_end: OnTurnEnd | None,
        *,
        max_total_tokens: int,
        vocab_size: int,
        weight_version: int,
    ):
        self.sampling, self.on_turn_end = sampling, on_turn_end
        self.max_total_tokens, self.vocab_size = max_total_tokens, vocab_size
        self.weight_version = weight_version
        self.episodes = list(episodes)  # (episode, turn now playing) of each start
        self.prompt_ids = prompt_ids
        self.last: list[Completion | None] = [None] * len(episodes)
        self.requests: list[Request] = []  # every turn's, in the order they were made

    def first_requests(self) -> list[Request]:
        return [
            self._request(i, ids, turn, cached=0)
            for i, (ids, (_, turn)) in enumerate(zip(self.prompt_ids, self.episodes))
        ]

    def next_turn(self, request: Request) -> Request | None:
        """The request of the episode's next turn (no slot yet), or None when it is over."""
        index = request.prompt_index
        turn = request.completion(self.weight_version, self.sampling.logprob_temperature)
        self.last[index] = turn
        if self.on_turn_end is None:
            return None
        following = self.on_turn_end(index, turn)
        if following is None:
            return None
        if not isinstance(following, Continuation):
            raise TypeError(f"on_turn_end must return a Continuation or None, got {following!r}")
        kept = self._kept(following, len(request.token_ids))
        transcript = [*request.prompt_ids, *request.token_ids[:kept], *self._ids(following)]
        room = self.max_total_tokens - len(transcript)
        if not is_int(following.max_new_tokens) or not 1 <= following.max_new_tokens <= room:
            raise ValueError(
                f"episode {index}: a continuation of {len(transcript)} ids leaves room for "
                f"1 to {room} new tokens within max_total_tokens = {self.max_total_tokens}, "
                f"got max_new_tokens = {following.max_new_tokens!r}"
            )
        # the slot holds the transcript before the turn and every turn token but the last
        held = len(request.prompt_ids) + min(kept, len(request.token_ids) - 1)
        cached = min(held, len(transcript) - 1)
        episode, number = self.episodes[index]
        self.episodes[index] = (episode, number + 1)
        return self._request(index, transcript, number + 1, cached, following.max_new_tokens)

    def last_turns(self) -> list[Completion]:
        """Each episode's last turn, in the order of the starts."""
        missing = [i for i, c in enumerate(self.last) if c is None]
        if missing:
            raise RuntimeError(f"episodes {missing[:5]} never finished a turn")
        return list(self.last)

    def _request(self, index, ids, turn, cached, max_new_tokens=None) -> Request:
        if max_new_tokens is None:
            max_new_tokens = turn_budget(
                self.sampling.max_new_tokens, len(ids), self.max_total_tokens
            )
        episode = self.episodes[index][0]
        request = Request(
            index,
            0,
            list(ids),
            turn_key(self.sampling.seed, episode, turn),
            shares_prefill=turn == 1,
            max_new_tokens=max_new_tokens,
            cached=cached,
        )
        self.requests.append(request)
        return request

    @staticmethod
    def _kept(following: Continuation, length: int) -> int:
        kept = length if following.kept is None else following.kept
        if not is_int(kept) or not 0 <= kept <= length:
            raise ValueError(f"Continuation.kept must be in [0, {length}], got {kept!r}")
        return kept

    def _ids(self, following: Continuation) -> list[int]:
        ids = list(following.observation_ids)
        bad = [t for t in ids if not is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"an observation holds token id {bad[0]!r}, outside the vocabulary of "
                f"{self.vocab_size}"
            )
        return [int(t) for t in ids]


def check_starts(starts) -> list[tuple[int, int]]:
    """(episode, turn) of each TurnStart; TypeError / ValueError naming the bad one."""
    if not isinstance(starts, Sequence):
        raise TypeError(f"starts must be a list of TurnStart, got {type(starts).__name__}")
    return [_checked_start(i, s) for i, s in enumerate(starts)]


def _checked_start(index: int, start) -> tuple[int, int]:
    """(episode, turn) of one TurnStart."""
    if not isinstance(start, TurnStart):
        raise TypeError(f"starts[{index}] must be a TurnStart, got {type(start).__name__}")
    if not is_int(start.episode) or start.episode < 0:
        raise ValueError(f"starts[{index}].episode must be an int >= 0, got {start.episode!r}")
    if not is_int(start.turn) or start.turn < 1:
        raise ValueError(f"starts[{index}].turn must be an int >= 1, got {start.turn!r}")
    return start.episode, start.turn
