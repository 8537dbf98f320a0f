"""Multi-turn episodes: `run_episodes` alternates model turns and environment observations.

An episode is one sample of one prompt: its own environment instance (`Class(**env_args)`),
`reset(record)`, then turns. Each turn the model samples (to EOS, a stop string or
`max_new_tokens`), the environment's `step` scores the turn and answers, and its observation
is appended to the transcript. It ends when `step` says done, after `max_turns` model turns,
at `max_total_tokens` (a model turn is cut there; an observation that would reach it is
dropped: env/truncated), or when an environment call fails (raise, wrong form, timeout:
counted, scored 0).

The result is an `Episode`: a `Completion` whose `token_ids` are everything after the prompt
(model turns and observations, in order), with `policy_mask` saying which tokens the policy
sampled. `logprobs` holds the policy's logprob of each of its tokens and 0 on the
environment's: those are context to the trainer, never scored (TrainBatch's response_mask is
the policy mask).

Two paths, one set of rules (`_Live.take_turn`, and `turn_budget` for each turn's tokens):
- `play_episodes` (play.py) runs the rules as the engine's turn-end hook: each episode's next
  turn continues in its own KV slot by a prefill at its length while the other episodes
  decode (`RolloutEngine.generate_episodes`); the job's engine actors play their episodes so.
- `run_episodes` here takes a `generate_turn` and calls it once per turn for every live
  episode; `transcript_turns` (play.py) sends each whole transcript as a fresh prompt with the
  seeds of the first path (turn t of episode `key` draws with the key of (seed, key, t)),
  so both give the same episodes. A tensor-parallel engine's episodes take this path.
Both are exact: prefill, prefill at an offset and decode are batch-invariant and equal, so every
sampled token's logprob equals the trainer's teacher-forced recompute of the whole transcript.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rl_engine.envs.codec import ObservationError, TurnCodec
from rl_engine.envs.protocol import Call, call_env, check_step
from rl_engine.rollout import Completion
from rl_engine.rollout.turns import Continuation, turn_budget

log = logging.getLogger("rl_engine.envs")


@dataclass
class Episode(Completion):
    """One episode as a Completion (module docstring); `reward` is its return, `finish_reason`
    how it ended: 'done', 'max_turns', 'truncated', 'error' or 'timeout'."""

    policy_mask: list[bool] = field(default_factory=list)
    """One per token_ids: True where the policy sampled the token, False for the environment's."""
    turn_rewards: list[float] = field(default_factory=list)
    """The reward of each model turn `step` scored (0 for a failed call)."""
    turns: int = 0
    """Model turns."""
    env_errors: int = 0
    """Environment calls that raised or returned something unusable."""
    env_timeouts: int = 0
    """Environment calls that ran past rollout.env_timeout_s."""
    truncated: bool = False
    """It reached rollout.max_total_tokens."""


@dataclass(frozen=True)
class EpisodeLimits:
    """rollout.max_turns, max_total_tokens, env_timeout_s and algorithm.turn_reward."""

    max_turns: int
    max_total_tokens: int
    timeout_s: float
    turn_reward: str = "sum"

    @classmethod
    def from_config(cls, config) -> EpisodeLimits:
        r = config.rollout
        return cls(r.max_turns, r.max_total_tokens, r.env_timeout_s, config.algorithm.turn_reward)

    def episode_return(self, rewards: list[float]) -> float:
        """'sum' of the turns' rewards, or the 'last' one (0 when no turn was scored)."""
        if not rewards:
            return 0.0
        return float(sum(rewards)) if self.turn_reward == "sum" else float(rewards[-1])


@dataclass(frozen=True)
class TurnRequest:
    """The next model turn of a live episode: its stable `key` and its whole transcript."""

    key: int
    ids: list[int]


# (requests, turn number from 1) -> one Completion per request, in order: its token_ids,
# logprobs, finish_reason, weight_version and logprob_temperature
GenerateTurn = Callable[[list[TurnRequest], int], Sequence[Completion]]


@dataclass(frozen=True)
class EpisodeTask:
    """One episode to play: its prompt record, prompt and sample index, and `key`, the episode
    index that seeds its turns (prompt index x samples_per_prompt + sample index)."""

    record: dict
    prompt_index: int
    sample_index: int
    key: int


def episode_tasks(records: Sequence[dict], samples_per_prompt: int) -> list[EpisodeTask]:
    """`samples_per_prompt` episodes of each record, prompt-major."""
    return [
        EpisodeTask(record, p, s, p * samples_per_prompt + s)
        for p, record in enumerate(records)
        for s in range(samples_per_prompt)
    ]


def start_episodes(tasks, make_env, codec: TurnCodec, limits: EpisodeLimits) -> list[_Live]:
    """Each task's environment instance, reset, and prompt (in order)."""
    return [
        _Live.start(t.key, t.prompt_index, t.sample_index, t.record, make_env, codec, limits)
        for t in tasks
    ]


def run_episodes(
    records: list[dict],
    samples_per_prompt: int,
    generate_turn: GenerateTurn,
    *,
    make_env: Callable[[], object],
    codec: TurnCodec,
    limits: EpisodeLimits,
) -> list[Episode]:
    """`samples_per_prompt` episodes of each record (dicts with `prompt_ids` and the optional
    `prompt`, `answer`, `extra_info`), prompt-major; `prompt_index` is the record's index.
    The whole-transcript path: every turn of the live episodes is one `generate_turn` call."""
    tasks = episode_tasks(records, samples_per_prompt)
    live = start_episodes(tasks, make_env, codec, limits)
    for turn in range(1, limits.max_turns + 1):
        active = [e for e in live if e.end is None]
        if not active:
            break
        samples = generate_turn([TurnRequest(e.key, list(e.ids)) for e in active], turn)
        if len(samples) != len(active):
            raise RuntimeError(f"generate_turn answered {len(samples)} of {len(active)} turns")
        for e, sample in zip(active, samples):
            e.take_turn(sample, turn, codec, limits)
    return [e.episode(limits) for e in live]


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """env/turns_mean, env/multi_turn_fraction (episodes of more than one model turn: with the
    calculator, those that called the tool), env/errors, env/timeouts, env/truncated (counts)."""
    count = max(len(episodes), 1)
    return {
        "env/turns_mean": sum(e.turns for e in episodes) / count,
        "env/multi_turn_fraction": sum(e.turns > 1 for e in episodes) / count,
        "env/errors": float(sum(e.env_errors for e in episodes)),
        "env/timeouts": float(sum(e.env_timeouts for e in episodes)),
        "env/truncated": float(sum(e.truncated for e in episodes)),
    }


class _Live:
    """An episode while it runs: its environment, transcript, and how it ended (None: running)."""

    def __init__(self, key: int, prompt_index: int, sample_index: int, prompt: list[int], env):
        self.key, self.prompt_index, self.sample_index = key, prompt_index, sample_index
        self.prompt, self.env = prompt, env
        self.ids = list(prompt)
        self.logprobs: list[float] = []
        self.mask: list[bool] = []
        self.rewards: list[float] = []
        self.turns = self.errors = self.timeouts = 0
        self.truncated = False
        self.end: str | None = None
        self.sampled: Completion | None = None  # the last turn: its weight version and T

    @classmethod
    def start(cls, key, p, s, record: dict, make_env, codec: TurnCodec, limits: EpisodeLimits):
        """The environment instance and the episode's prompt (reset's, or the record's)."""
        prompt = [int(t) for t in record["prompt_ids"]]
        if not 0 < len(prompt) < limits.max_total_tokens:
            raise ValueError(
                f"prompt {p} has {len(prompt)} tokens: an episode needs 1 to "
                f"rollout.max_total_tokens - 1 = {limits.max_total_tokens - 1}"
            )
        live = cls(key, p, s, prompt, None)
        made = call_env("the environment's constructor", make_env, timeout_s=limits.timeout_s)
        if not live.counted(made):
            return live
        record = {**record, "prompt_ids": list(prompt)}  # the environment may keep or change it
        reset = call_env("reset", made.value.reset, record, timeout_s=limits.timeout_s)
        if not live.counted(reset):
            return live
        if reset.value is not None:
            own = _call_codec(codec.prompt_ids, reset.value, "reset's prompt")
            if own.ok and len(own.value) >= limits.max_total_tokens:
                own = Call(
                    error=f"reset's prompt of {len(own.value)} tokens reaches max_total_tokens"
                )
            if not live.counted(own):
                return live
            live.prompt, live.ids = own.value, list(own.value)
        live.env = made.value
        return live

    def counted(self, call: Call) -> bool:
        """Whether `call` succeeded; a failure is counted and logged (the caller ends the episode)."""
        if call.ok:
            return True
        self.timeouts += call.timed_out
        self.errors += not call.timed_out
        log.warning("episode %d/%d: %s", self.prompt_index, self.sample_index, call.error)
        return False

    def take_turn(self, sample: Completion, turn: int, codec: TurnCodec, limits: EpisodeLimits):
        """Append the model's turn (cut at a stop string or the token budget), score it with
        `step`, then append the observation or end the episode."""
        self.sampled, tokens = sample, list(sample.token_ids)
        keep = codec.stop_cut(tokens)
        tokens = tokens if keep is None else tokens[:keep]
        room = limits.max_total_tokens - len(self.ids)
        if len(tokens) >= room:
            tokens, self.truncated = tokens[:room], True
        self._append(tokens, sample.logprobs[: len(tokens)].tolist(), policy=True)
        self.turns += 1
        if self.env is None:  # its constructor or reset failed: one unscored turn
            self.end = "error"
            return
        turn_in = {"completion_ids": tokens, "completion": codec.text(tokens)}
        result = call_env(
            "step", self.env.step, turn_in, timeout_s=limits.timeout_s, check=check_step
        )
        if not self.counted(result):
            self.rewards.append(0.0)
            self.end = "timeout" if result.timed_out else "error"
            return
        observation, reward, done = result.value
        self.rewards.append(reward)
        if done or self.truncated or turn == limits.max_turns:
            self.end = "done" if done else "truncated" if self.truncated else "max_turns"
            return
        seen = _call_codec(codec.observation_ids, observation, "the observation")
        if not self.counted(seen):
            self.end = "error"
        elif len(self.ids) + len(seen.value) >= limits.max_total_tokens:
            self.truncated, self.end = True, "truncated"  # no room left for the model to answer
        else:
            self._append(seen.value, [0.0] * len(seen.value), policy=False)

    def continue_after(
        self, sample: Completion, codec: TurnCodec, limits: EpisodeLimits, max_new_tokens: int
    ) -> Continuation | None:
        """`take_turn` for the engine's turn-end hook: the next turn in the episode's own
        slot (its kept tokens, the observation, `turn_budget`), or None when it ended."""
        before = len(self.ids)
        self.take_turn(sample, self.turns + 1, codec, limits)
        if self.end is not None:
            return None
        kept = sum(
            self.mask[before - len(self.prompt) :]
        )  # the turn's tokens, then the observation
        budget = turn_budget(max_new_tokens, len(self.ids), limits.max_total_tokens)
        return Continuation(self.ids[before + kept :], budget, kept)

    def _append(self, ids: list[int], logprobs: list[float], *, policy: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [policy] * len(ids)

    def episode(self, limits: EpisodeLimits) -> Episode:
        if self.sampled is None:
            raise RuntimeError(f"episode {self.key} ended without a model turn")
        return Episode(
            prompt_ids=list(self.prompt),
            token_ids=self.ids[len(self.prompt) :],
            logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            finish_reason=self.end or "max_turns",
            weight_version=self.sampled.weight_version,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            logprob_temperature=self.sampled.logprob_temperature,
            reward=limits.episode_return(self.rewards),
            policy_mask=list(self.mask),
            turn_rewards=list(self.rewards),
            turns=self.turns,
            env_errors=self.errors,
            env_timeouts=self.timeouts,
            truncated=self.truncated,
        )


def _call_codec(fn, value, what: str) -> Call:
    """A codec conversion of what the environment returned: its ObservationError counted."""
    try:
        return Call(fn(value))
    except ObservationError as err:
        return Call(error=f"{what}: {err}")
