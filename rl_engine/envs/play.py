"""Episodes played inside one engine's continuous batching: `play_episodes`.

Every episode's environment lives in the process of the engine that plays it: one instance
per episode (`Class(**env_args)`), each call under `rollout.env_timeout_s`, with the rules of
`_Live.take_turn` (episode.py; the whole-transcript `run_episodes` applies the same ones).
The engine (`RolloutEngine.generate_episodes`, rl_engine/rollout/turns.py) samples each
episode's first turn; when a turn ends, its hook here scores it with `step` and answers with
the next turn (the kept tokens, the observation, `turn_budget`) or None. The next turn keeps
the episode's KV slot and is prefilled at the slot's length while the other episodes decode:
an episode whose turn ended continues at once, without waiting for the others.

Seeds: turn t of episode k draws with the key of (sampling.seed, k, t) (`turn_key`), so its
tokens depend neither on the slot count nor on which engine plays it, and equal the
whole-transcript path's with the same seeds (each turn sent as `TurnStart(transcript, k, t)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from rl_engine.envs.codec import TurnCodec
from rl_engine.envs.episode import Episode, EpisodeLimits, EpisodeTask, start_episodes
from rl_engine.rollout.turns import TurnStart


def play_episodes(
    engine,
    tasks: Sequence[EpisodeTask],
    sampling,
    *,
    make_env: Callable[[], object],
    codec: TurnCodec,
    limits: EpisodeLimits,
    progress: bool | None = False,
) -> list[Episode]:
    """The episodes of `tasks` (in order), every turn on `engine` (a RolloutEngine) by
    `sampling` (n = 1; its max_new_tokens bounds each turn, within max_total_tokens)."""
    live = start_episodes(tasks, make_env, codec, limits)
    if not live:
        return []

    def on_turn_end(index: int, turn):
        return live[index].continue_after(turn, codec, limits, sampling.max_new_tokens)

    engine.generate_episodes(
        [TurnStart(e.ids, e.key) for e in live],
        replace(sampling, n=1),
        on_turn_end,
        max_total_tokens=limits.max_total_tokens,
        progress=progress,
    )
    return [e.episode(limits) for e in live]


# (starts, sampling, max_total_tokens) -> each start's turn: an engine's generate_episodes
# without a hook, or the same spread over engines
PlayTurns = Callable[[list[TurnStart], object, int], Sequence]


def transcript_turns(play_turns: PlayTurns, sampling, limits: EpisodeLimits):
    """A `generate_turn` for `run_episodes` (the whole-transcript path) with the seeds and
    budgets of `play_episodes`: turn t of episode k is `TurnStart(whole transcript, k, t)`,
    a fresh prompt, so its tokens and logprobs are those of the continuous path."""
    turn_sampling = replace(sampling, n=1)

    def generate_turn(requests, turn: int):
        starts = [TurnStart(r.ids, r.key, turn) for r in requests]
        return play_turns(starts, turn_sampling, limits.max_total_tokens)

    return generate_turn
