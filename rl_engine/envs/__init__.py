"""Multi-turn environments: the model's turns alternate with an environment's observations.

- `protocol`: what an environment is (`Environment`: `reset(record)`, `step(turn)`), loading
  `rollout.env` (`load_environment`), and each call under `rollout.env_timeout_s` (`call_env`);
- `codec`: text <-> ids for turns, observations (the chat template's tool role), reset's
  prompts, and `rollout.stop_strings` (`TurnCodec`);
- `episode`: an episode's rules (`_Live.take_turn`: turns, observations, limits, failures),
  its record (`Episode`, a Completion with a `policy_mask`), the whole-transcript loop
  (`run_episodes`: every turn a fresh prompt) and the env/* metrics;
- `play`: episodes played inside one engine's continuous batching (`play_episodes`: the
  engine's turn-end hook continues each episode in its own KV slot), and the
  whole-transcript path with the same seeds (`transcript_turns`);
- `files`: episodes in rollout files (the `policy_mask` field);
- the shipped environments: `calculator` (`<calc>3*7</calc>` -> 21), `guess_number`.

Plain Python over the rollout layer: no Ray, no DeepSpeed, no job (the job plays the
episodes in its engine actors: rl_engine/executors/job/episodes.py).
"""

from rl_engine.envs.codec import ObservationError, TurnCodec
from rl_engine.envs.episode import (
    Episode,
    EpisodeLimits,
    EpisodeTask,
    TurnRequest,
    episode_metrics,
    episode_tasks,
    run_episodes,
)
from rl_engine.envs.play import play_episodes, transcript_turns
from rl_engine.envs.protocol import Call, Environment, call_env, load_environment

__all__ = [
    "Call",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "EpisodeTask",
    "ObservationError",
    "TurnCodec",
    "TurnRequest",
    "call_env",
    "episode_metrics",
    "episode_tasks",
    "load_environment",
    "play_episodes",
    "run_episodes",
    "transcript_turns",
]
