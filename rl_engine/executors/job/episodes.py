"""The step's episodes (`rollout.env`): the episode rules of rl_engine.envs on the rollout engines.

`EpisodeRunner` (built once the engines have reported their tokenizer and vocabulary) holds
the environment class, the codec and the limits; `run` plays `samples_per_prompt` episodes of
each prompt record. `EpisodeGeneration` is `StepRollouts`'s generate with an environment: a
round's records -> their episodes, each carrying its reward (the environment's,
`algorithm.turn_reward`).

Where the environments run. The driver sends each engine its share of the episodes (each
prompt's episodes to one engine, prompts round-robin) as `EpisodeTask`s (the record, prompt
and sample index, the episode index); the engine's actor builds its own `EpisodeRunner` and
plays them with `play_episodes` (RolloutActor.play_episodes): one environment instance per
episode (`Class(**rollout.env_args)`), each call under `rollout.env_timeout_s` in the actor's
main thread (a raise or a timeout is counted in env/* and scored 0, never hangs), and each
episode's next turn continues in its own KV slot while the engine's other episodes decode.
The episodes come back to the driver, which reports env/* as before.

A tensor-parallel engine (rollout.tensor_parallel_size > 1) keeps the environments in the
driver and plays the whole-transcript path (`run_episodes`, each turn one
`generate_episodes` call per engine with the transcripts as fresh prompts): its ranks would
otherwise each run the environments and would have to take the same decision after every
turn. Both paths are exact, and give the same episodes.

Seeds: turn t of the episode with index k (prompt index x samples_per_prompt + sample index)
draws with the key of (the round's seed, k, t) (rl_engine/rollout/turns.py), so an
episode depends neither on the engine that plays it, nor on the engine count or slot count.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.config import RunConfig
from rl_engine.data import PromptRecord
from rl_engine.envs import (
    Episode,
    EpisodeLimits,
    EpisodeTask,
    TurnCodec,
    episode_tasks,
    load_environment,
    play_episodes,
    run_episodes,
    transcript_turns,
)
from rl_engine.executors.job.faults import ActorInfo, gather
from rl_engine.executors.job.rollouts import engine_leads, step_sampling
from rl_engine.executors.job.step_metrics import StepClock


class EpisodeRunner:
    """The run's environment: `run(records, samples, engines, sampling)` -> episodes (in the
    driver); `play(engine, tasks, sampling)` -> episodes (in an engine's actor)."""

    def __init__(self, config: RunConfig, tokenizer, vocab_size: int):
        r = config.rollout
        self.env_class = load_environment(r.env)
        self.env_args = dict(r.env_args)
        self.codec = TurnCodec(tokenizer, vocab_size, tuple(r.stop_strings))
        self.limits = EpisodeLimits.from_config(config)
        self.tensor_parallel = r.tensor_parallel_size > 1

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
        """The episodes of `records` (prompt-major), each turn sampled by `sampling` (n = 1);
        the slowest engine's time to `clock`'s generate_compute."""
        records = [self.reset_record(r) for r in records]
        if self.tensor_parallel:
            episodes, seconds = self._whole_transcripts(
                records, samples_per_prompt, engines, sampling
            )
        else:
            tasks = episode_tasks(records, samples_per_prompt)
            episodes, seconds = play_on_engines(engines, tasks, sampling)
        if clock is not None:
            clock.add("generate_compute", seconds)
        return episodes

    def play(self, engine, tasks: list[EpisodeTask], sampling) -> list[Episode]:
        """The episodes of `tasks` on `engine`, the environments in this process."""
        return play_episodes(
            engine, tasks, sampling, make_env=self.make_env, codec=self.codec, limits=self.limits
        )

    def _whole_transcripts(self, records, samples_per_prompt, engines, sampling):
        """The tensor-parallel path: the environments here, every turn a call per engine."""
        spent = [0.0]

        def play_turns(starts, turn_sampling, max_total_tokens):
            completions, seconds = turns_on_engines(
                engines, starts, turn_sampling, max_total_tokens
            )
            spent[0] += seconds
            return completions

        episodes = run_episodes(
            records,
            samples_per_prompt,
            transcript_turns(play_turns, sampling, self.limits),
            make_env=self.make_env,
            codec=self.codec,
            limits=self.limits,
        )
        return episodes, spent[0]

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


def play_on_engines(engines: list[ActorInfo], tasks: list[EpisodeTask], sampling):
    """The episodes of `tasks` played in the engines' actors, each prompt's on one engine
    (prompts round-robin): (episodes in task order, the slowest engine's seconds)."""
    leads = engine_leads(engines)
    shards = {e.rank: [t for t in tasks if t.prompt_index % len(leads) == e.rank] for e in leads}
    busy = [e for e in leads if shards[e.rank]]
    answers = gather([(e, e.handle.play_episodes.remote(shards[e.rank], sampling)) for e in busy])
    played = {}
    for e, (episodes, _) in zip(busy, answers):
        if len(episodes) != len(shards[e.rank]):
            raise RuntimeError(f"{e.name} played {len(episodes)} of {len(shards[e.rank])} episodes")
        played.update((t.key, episode) for t, episode in zip(shards[e.rank], episodes))
    return [played[t.key] for t in tasks], max((s for _, s in answers), default=0.0)


def turns_on_engines(engines: list[ActorInfo], starts, sampling, max_total_tokens: int):
    """One turn of the live episodes (whole transcripts as `TurnStart`s) spread over the
    engines; every TP rank of an engine gets its engine's starts and its rank 0 answers:
    (completions in start order, the slowest engine's seconds)."""
    count = len(engine_leads(engines))
    shards = [list(range(i, len(starts), count)) for i in range(count)]
    calls = [
        (
            e,
            e.handle.play_turns.remote(
                [starts[j] for j in shards[e.rank]], sampling, max_total_tokens
            ),
        )
        for e in engines
    ]
    answers = [answer for e, answer in zip(engines, gather(calls)) if not e.tp_rank]
    completions, seconds = [None] * len(starts), 0.0
    for idx, (result, spent) in zip(shards, answers):
        seconds = max(seconds, spent)
        for j, completion in zip(idx, result):
            completions[j] = completion
    return completions, seconds
