"""The RL job: Ray starts N DeepSpeed ranks and M rollout engines (and, for PPO, the critic's
own DeepSpeed ranks) and runs GRPO / PPO steps.

One step (`_Job.step`) reads top to bottom, one call per stage, each stage a module:

    (step 0: validation of the initial policy)                     evaluation
    rollouts: the step's prompts -> the engines generate,           rollouts, prompts, scorers
        recording logprobs (or the next groups of rollout.source;     (episodes)
        rollout.env: episodes of model turns and observations)
        -> rewards (filter_groups: more rounds)
    batch: completions and rewards -> the TrainBatch                step_batch
    train: (PPO: the critic's values -> GAE advantages, the         training, ppo_step
        critic's update beside the policy's) every rank trains on
        its shard, checking its logprobs against the rollout's
    sync: the ranks' new weights straight into every engine (as     weight_sync
        the worker's weight_version; the driver never holds them)
    (validation when due)                                           evaluation
    report: the metrics row -> every tracker, the progress bar      step_metrics, trackers
    (a checkpoint when due; weights written by rank 0)              job_checkpoints

With rollout.max_staleness k >= 1 (asynchronous RL, `async_schedule`) the step's rollouts
were generated while earlier steps trained, and the rollouts of later steps are generated
while this one trains; the new ones are checked against the weights that sampled them before
the sync.

Around the steps: `actors` (the actor classes; placing, checking and starting them),
`preflight`, `run_dir`, `cluster`, `faults`, `job_reports`, `progress`.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import ray

from rl_engine.config import RunConfig
from rl_engine.data.tasks import make_task
from rl_engine.executors.job import cluster
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.actors.launch import (
    check_kernel_parity,
    describe_actors,
    spawn_actors,
    spawn_critics,
    start_actors,
)
from rl_engine.executors.job.async_schedule import AsyncPipeline, ReadyRollouts
from rl_engine.executors.job.episodes import EpisodeGeneration, EpisodeRunner
from rl_engine.executors.job.evaluation import build_evaluator, run_if_due
from rl_engine.executors.job.faults import (
    ActorFailure,
    ActorInfo,
    JobStopped,
    StopOnSignal,
    gather,
    stop_actors,
)
from rl_engine.executors.job.job_reports import after_stop_note, write_summary
from rl_engine.executors.job.preflight import validate_before_start
from rl_engine.executors.job.progress import StepProgress
from rl_engine.executors.job.prompts import run_prompts
from rl_engine.executors.job.rollouts import StepGeneration, StepRollouts
from rl_engine.executors.job.run_dir import CONFIG_SNAPSHOT, prepare_run_dir, truncate_metrics
from rl_engine.executors.job.scorers import reward_runner, step_scorer
from rl_engine.executors.job.speculation import speculation_metrics
from rl_engine.executors.job.step_batch import train_batch
from rl_engine.executors.job.step_metrics import StepClock, step_record
from rl_engine.executors.job.trackers import Trackers
from rl_engine.executors.job.training import train_on_batch
from rl_engine.executors.job.weight_sync import (
    connect_weight_sync,
    release_weights,
    sync_weights,
)
from rl_engine.rewards import RewardFailure

__all__ = ["run_job"]

log = logging.getLogger("rl_engine.job")


def run_job(config: RunConfig, *, resume: bool = False, overwrite: bool = False) -> list[dict]:
    """Run (or with `resume`, continue) the job in `config.output_dir`; returns every step's metrics.

    Raises JobStopped (with the exit code) when an actor fails or a signal stops the run;
    ValueError for anything wrong with the config or the run directory (before Ray starts).
    """
    validate_before_start(config)
    run_dir = prepare_run_dir(config.output_dir, resume=resume, overwrite=overwrite)
    start = ckpt.resume_point(run_dir, resume)
    history = truncate_metrics(run_dir, start.step if start else 0) if resume else []
    config.to_yaml(run_dir / CONFIG_SNAPSHOT)
    owns_ray = cluster.connect(config)
    job = _Job(config, run_dir, history)
    try:
        with StopOnSignal() as stop:
            job.start(start)
            job.train(stop)
        return job.history
    except (ActorFailure, RewardFailure) as err:
        job.stop_actors()
        job.write_reports(status=f"failed: {err}")
        raise JobStopped(f"{err}\n{job.after_stop_note()}", 1) from None
    finally:
        try:
            job.release()
        finally:  # a failing release must not leave this process connected to its own cluster
            if owns_ray:
                ray.shutdown()


class _Job:
    """The driver's state for one run: its actors, the step loop, and what the run leaves."""

    def __init__(self, config: RunConfig, run_dir: Path, history: list[dict]):
        self.config, self.run_dir, self.history = config, run_dir, history
        self.engines: list[ActorInfo] = []
        self.trainers: list[ActorInfo] = []
        self.critics: list[ActorInfo] = []  # PPO's critic ranks (algorithm.name 'ppo')
        self.groups = []
        self.version = 0  # the weight version the engines serve
        self.last_checkpoint: ckpt.Checkpoint | None = None
        self.reward_runner = None  # DriverRewards or a RewardPool (closed at the end), if any
        self.episodes: EpisodeRunner | None = None  # rollout.env's episodes
        self.pipeline: AsyncPipeline | None = None  # rollout.max_staleness >= 1

    def start(self, resume_from: ckpt.Checkpoint | None) -> None:
        """Place and spawn the actors, check that they compute with the same kernels, then load
        models (and state) and build what the steps read."""
        self.trainers, self.engines = spawn_actors(self.config, self.groups)
        self.critics = spawn_critics(self.config, self.groups)
        describe_actors(self.actors, self.run_dir)
        check_kernel_parity(self.actors)  # bitwise parity's precondition, before any model loads
        started = time.perf_counter()
        resume_dir = str(resume_from.deepspeed_dir) if resume_from else None
        critic_dir = str(resume_from.critic_dir) if resume_from and self.critics else None
        self.info = start_actors(
            self.trainers, self.engines, resume_dir, critics=(self.critics, critic_dir)
        )
        self.prepare_steps()
        self.sync_size = connect_weight_sync(self.trainers, self.engines)
        self.base_synced = False  # a LoRA run's first sync moves the base too, once
        self.engines_released = False  # the engines hold no weights until the next sync
        if self.config.rollout.max_staleness:
            self.pipeline = AsyncPipeline(self.config, self.generate_rollouts, self.verify)
        if resume_from is not None:
            self.sync_weights(resume_from.weight_version)
            self.rollouts.prompts.restore(resume_from.driver, resume_from.step)
            if self.pipeline is not None:
                self.pipeline.restore(resume_from.path, resume_from.driver)
            self.last_checkpoint = resume_from
        log.info("actors ready in %.1f s", time.perf_counter() - started)

    def prepare_steps(self) -> None:
        """What the steps read, built once the engines have reported their model facts (the
        tokenizer datasets are tokenized with, vocab size, eos): the prompt source, the scorer
        (and the reward runner behind it), the step's rollouts, the validation set's evaluator."""
        config, info = self.config, self.info
        tokenizer, vocab = info["tokenizer"], info["vocab_size"]
        task = make_task(
            config.rollout.task, vocab_size=vocab, tokenizer=tokenizer, seed=config.seed
        )
        self.reward_runner = reward_runner(config)
        if config.rollout.env is not None:
            self.episodes = EpisodeRunner(config, tokenizer, vocab)
        scorer = step_scorer(config, task, self.reward_runner, tokenizer)
        prompts = run_prompts(config, task, tokenizer)
        self.rollouts = StepRollouts(config, task, vocab, prompts=prompts, scorer=scorer)
        self.evaluator = build_evaluator(
            config, self.reward_runner, tokenizer, info["eos_token_id"], self.episodes
        )

    @property
    def actors(self) -> list[ActorInfo]:
        return self.trainers + self.critics + self.engines

    # ------------------------------------------------------------------ steps

    def train(self, stop: StopOnSignal) -> None:
        """Steps from where the run stands to `config.steps`; a signal stops after a checkpoint."""
        config, first = self.config, len(self.history)
        log.info(
            "job: %d trainer rank(s), %d rollout engine(s) of %d process(es) each, "
            "batch_invariant=%s, steps %d..%d",
            len(self.trainers),
            config.rollout.num_engines,
            config.rollout.tensor_parallel_size,
            config.batch_invariant,
            first,
            config.steps - 1,
        )
        self.progress = StepProgress(config.steps, first)
        self.trackers = Trackers(config, self.run_dir, first)
        try:
            for step in range(first, config.steps):
                self.step(step, stop)
                if stop.requested and step + 1 < config.steps:
                    self.write_reports(status=f"stopped by signal after step {step}")
                    raise JobStopped(
                        f"stopped after step {step}; {self.after_stop_note()}", stop.exit_code
                    )
        finally:
            self.progress.close()
            self.trackers.close()
        self.write_reports(status="complete")

    def step(self, step: int, stop: StopOnSignal) -> dict:
        """One RL step: rollouts -> batch -> train -> weight sync -> (eval) -> report -> (checkpoint)."""
        clock, eos = StepClock(), self.info["eos_token_id"]
        evaluation = self.evaluate(step, clock, before=True)  # the initial policy, into row 0
        with clock.phase("rollout"):  # prompts -> engines (or rollout.source) -> rewards
            ready, rollout_metrics = self.step_rollouts(step, clock)
        self.release_engine_weights()
        with clock.phase("batch"):
            batch = train_batch(self.config, ready.completions, ready.rewards, eos)
        train = functools.partial(
            train_on_batch,
            *(self.config, self.trainers, self.critics, batch, ready.completions, step, clock),
        )
        if self.pipeline is None:
            trained = train()
        else:  # later steps' rollouts generated meanwhile, then checked
            trained, overlap = self.pipeline.beside(step, train, clock)
            rollout_metrics.update(overlap)
            rollout_metrics.update(_behaviour_figures(trained.policy, ready.parity))
        with clock.phase("weight_sync"):  # the whole sync, senders and receivers
            # the worker's version: a skipped (non-finite) update keeps the old weights and version
            synced = self.sync_weights(trained.policy["weight_version"])
        evaluation.update(self.evaluate(step, clock, before=False))
        extra = {**rollout_metrics, **evaluation, **trained.critic, "weight_sync/bytes": synced}
        record = step_record(step, trained.policy, ready.rewards, extra, clock.totals())
        self.report(record)
        if ckpt.due(self.config, step + 1, stop.requested):
            self.save_checkpoint(step + 1)
        return record

    def step_rollouts(self, step: int, clock: StepClock) -> tuple[ReadyRollouts, dict]:
        """The step's rollouts and their figures: generated now (synchronous), or taken from
        those generated beside earlier steps (asynchronous: with the async/* figures)."""
        if self.pipeline is None:
            ready = self.generate_rollouts(step, clock)
            return ready, dict(ready.metrics)
        ready, figures = self.pipeline.take(step, self.version, clock)
        return ready, {**ready.metrics, **figures}

    def generate_rollouts(self, step: int, clock: StepClock | None = None) -> ReadyRollouts:
        """Step `step`'s completions (or episodes) by the engines' current weights, scored."""
        clock = StepClock() if clock is None else clock  # generated ahead: timed apart
        completions, rewards, metrics = self.rollouts(step, self.generation(step, clock), clock)
        if self.config.rollout.speculative is not None and self.engines:
            metrics.update(speculation_metrics(self.engines))
        return ReadyRollouts(step, completions, rewards, metrics)

    def verify(self, ready: ReadyRollouts) -> dict:
        """The ranks' parity/* of rollouts generated beside a step, against the weights that
        sampled them (each rank its shard; none under parity 'off')."""
        if self.config.parity == "off":
            return {}
        batch = train_batch(
            self.config, ready.completions, ready.rewards, self.info["eos_token_id"]
        )
        world = len(self.trainers)
        calls = [
            (t, t.handle.verify_behaviour.remote(batch.shard(r, world)))
            for r, t in enumerate(self.trainers)
        ]
        return gather(calls)[0]

    def generation(self, step: int, clock: StepClock):
        """The step's generation on the engines: completions, or rollout.env's episodes."""
        eos = self.info["eos_token_id"]
        if self.episodes is not None:
            return EpisodeGeneration(self.engines, self.config, step, eos, clock, self.episodes)
        return StepGeneration(self.engines, self.config, step, eos, clock)

    def evaluate(self, step: int, clock: StepClock, *, before: bool) -> dict:
        """Validation figures due before (step 0) or after this step; {} when none is due."""
        return run_if_due(
            self.evaluator, self.engines, step, clock, before=before, updates=self.version
        )

    def report(self, record: dict) -> None:
        """The step's metrics row to every tracker, the run's history and the progress bar."""
        self.trackers.log(record)
        self.history.append(record)
        self.progress.update(record)

    def sync_weights(self, version: int) -> int:
        """The ranks' weights (of `version`) into every engine; nothing to do when the engines
        serve it already and hold it (`release_engine_weights` did not release it; a skipped
        update leaves the weights bitwise as they were; at the start, engines and ranks load
        the same version-0 weights). A LoRA run's syncs after the first move only the
        adapters. Returns the bytes of the distinct tensors sent."""
        if version == self.version and not self.engines_released:
            return 0
        adapters_only = self.config.lora.enabled and self.base_synced
        self.version = sync_weights(self.trainers, self.engines, version, adapters_only)
        self.base_synced, self.engines_released = True, False
        return self.sync_size.adapters if adapters_only else self.sync_size.full

    def release_engine_weights(self) -> None:
        """A full-weight run's engines give their weights' memory back while the ranks train
        (their peak): the sync after the step rewrites every weight, and runs even after a
        skipped update. A LoRA run's later syncs move only the adapters: its engines keep theirs."""
        if self.config.lora.enabled or not self.engines or self.pipeline is not None:
            return  # (asynchronous runs generate while the ranks train)
        release_weights(self.engines)
        self.engines_released = True

    def save_checkpoint(self, step: int) -> None:
        self.last_checkpoint = ckpt.save(
            self.run_dir,
            self.config,
            self.trainers,
            step=step,
            weight_version=self.version,
            driver_state=self.rollouts.prompts.state(),
            critics=self.critics,
            extra=None if self.pipeline is None else self.pipeline.save,
        )

    # ------------------------------------------------------------------ what the run leaves

    def after_stop_note(self) -> str:
        return after_stop_note(self.run_dir, self.last_checkpoint)

    def write_reports(self, status: str) -> None:
        write_summary(self.run_dir, self.config, status, self.history, self.actors)

    def stop_actors(self) -> None:
        stop_actors(self.actors)

    def release(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        if self.reward_runner is not None:
            self.reward_runner.close()
        self.stop_actors()
        cluster.release(self.groups)


def _behaviour_figures(policy: dict, carried: dict) -> dict:
    """The behaviour/proximal ratio's figures, and a stale step's parity/* from its check
    (its own forward ran with newer weights: it checks nothing)."""
    policy.update(carried)
    if "parity/num_tokens" in policy:  # an on-policy step checked its own tokens
        policy.setdefault("parity/unverified_tokens", 0.0)
    return {
        "async/behaviour_ratio_mean": policy.get("correction/ratio_mean", 1.0),
        "async/behaviour_ratio_max": policy.get("correction/ratio_max", 1.0),
    }
