"""Multi-turn environments: the model's turns alternate with an environment's observations.

- `protocol`: what an environment is (`Environment`: `reset(record)`, `step(turn)`), loading
  `rollout.env` (`load_environment`), and each call under `rollout.env_timeout_s` (`call_env`);
- `codec`: text <-> ids for turns, observations (the chat template's tool role), reset's
  prompts, and `rollout.stop_strings` (`TurnCodec`);
- `episode`: the episode loop (`run_episodes`) and its record (`Episode`, a Completion with a
  `policy_mask`), the limits and the env/* metrics;
- `files`: episodes in rollout files (the `policy_mask` field);
- the shipped environments: `calculator` (`<calc>3*7</calc>` -> 21), `guess_number`.

Plain Python over the rollout layer's records: no Ray, no DeepSpeed, no job (the job runs the
loop with its engines: rl_engine/executors/job/episodes.py).
"""

from rl_engine.envs.codec import ObservationError, TurnCodec
from rl_engine.envs.episode import (
    Episode,
    EpisodeLimits,
    TurnRequest,
    episode_metrics,
    run_episodes,
)
from rl_engine.envs.protocol import Call, Environment, call_env, load_environment

__all__ = [
    "Call",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "ObservationError",
    "TurnCodec",
    "TurnRequest",
    "call_env",
    "episode_metrics",
    "load_environment",
    "run_episodes",
]
