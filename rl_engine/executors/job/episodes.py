"""The step's episodes (`rollout.env`): the episode loop of rl_engine.envs on the rollout engines.

`EpisodeRunner` (built once the engines have reported their tokenizer and vocabulary) holds
the environment class, the codec and the limits; `run` plays `samples_per_prompt` episodes of
each prompt record. The environments live in the driver: one instance per episode, each call
under `rollout.env_timeout_s` (a raise or a timeout is counted in env/* and scored 0).
`EpisodeGeneration` is `StepRollouts`'s generate with an environment: a round's records ->
their episodes, each carrying its reward (the environment's, `algorithm.turn_reward`).

Each model turn is one `generate` call per engine whose prompts are the live episodes' whole
transcripts (`_turns_on_engines`). That is exact as it stands: prefill is batch-invariant and
equal to decode bit for bit, so every sampled token's logprob is the trainer's recompute of
the whole transcript. Seeds: turn t of a step samples on engine k with a seed of (the step's
seed, t, k); each episode is a different request index within its engine's call, so no two
episodes share a generator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from rl_engine.config import RunConfig
from rl_engine.data import PromptRecord
from rl_engine.envs import (
    Episode,
    EpisodeLimits,
    TurnCodec,
    TurnRequest,
    load_environment,
    run_episodes,
)
from rl_engine.executors.job.faults import ActorInfo
from rl_engine.executors.job.rollouts import engine_leads, generate_on_engines, step_sampling
from rl_engine.executors.job.step_metrics import StepClock


class EpisodeRunner:
    """The run's environment: `run(records, samples, engines, sampling)` -> episodes."""

    def __init__(self, config: RunConfig, tokenizer, vocab_size: int):
        r = config.rollout
        self.env_class = load_environment(r.env)
        self.env_args = dict(r.env_args)
        self.codec = TurnCodec(tokenizer, vocab_size, tuple(r.stop_strings))
        self.limits = EpisodeLimits.from_config(config)

    def make_env(self):
        return self.env_class(**self.env_args)

    def run(
        self,
        records: list[PromptRecord],
        samples_per_prompt: int,
        engines: list[ActorInfo],
        sampling,
        clock: StepClock | None = None,
    ) -> list[Episode]:
        """The episodes of `records` (prompt-major), each turn sampled by `sampling` (n = 1,
        its seed mixed with the turn and the engine); the engines' time to `clock`."""

        def generate_turn(requests: list[TurnRequest], turn: int):
            completions, seconds = _turns_on_engines(engines, requests, sampling, turn)
            if clock is not None:
                clock.add("generate_compute", seconds)
            return completions

        return run_episodes(
            [self.reset_record(r) for r in records],
            samples_per_prompt,
            generate_turn,
            make_env=self.make_env,
            codec=self.codec,
            limits=self.limits,
        )

    @staticmethod
    def reset_record(record: PromptRecord) -> dict:
        """What `reset` receives: prompt_ids, and the prompt text (the last user turn's),
        answer and extra_info where the task or dataset has them (else None)."""
        users = [m["content"] for m in record.messages if m.get("role") == "user"]
        return {
            "prompt_ids": list(record.prompt_ids),
            "prompt": users[-1] if users else None,
            "answer": record.ground_truth,
            "extra_info": record.extra_info,
        }


@dataclass
class EpisodeGeneration:
    """Generation of step `step` with rollout.env, as `StepRollouts` calls it: (records of
    round `attempt`) -> their episodes, sampled with the round's seed (`step_sampling`)."""

    engines: list[ActorInfo]
    config: RunConfig
    step: int
    eos_token_id: object
    clock: StepClock
    runner: EpisodeRunner

    def __call__(self, records: list[PromptRecord], attempt: int = 0) -> list[Episode]:
        sampling = step_sampling(self.config, self.step, self.eos_token_id, attempt)
        samples = self.config.rollout.samples_per_prompt
        return self.runner.run(records, samples, self.engines, sampling, self.clock)


def _turns_on_engines(engines: list[ActorInfo], requests: list[TurnRequest], sampling, turn: int):
    """One turn of the live episodes over the engines: (completions in request order, the
    slowest engine's seconds)."""
    count = len(engine_leads(engines))
    per_engine = [
        replace(sampling, n=1, seed=turn_seed(sampling.seed, turn, k)) for k in range(count)
    ]
    prompts = [r.ids for r in requests]
    # turns count from 1: turn 1 is the prompt itself, later ones continue after an observation
    return generate_on_engines(engines, prompts, per_engine, after_env_turn=turn > 1)


def turn_seed(seed: int, turn: int, engine: int) -> int:
    """The 63-bit sampling seed of a turn on one engine, a function of (the round's seed,
    turn, engine index)."""
    digest = hashlib.blake2b(f"turn/{seed}/{turn}/{engine}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
