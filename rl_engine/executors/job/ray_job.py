"""The RL job: Ray starts N DeepSpeed ranks and M rollout engines (and, for PPO, the critic's
own DeepSpeed ranks) and runs GRPO / PPO steps.

One step (`_Job.step`, top to bottom): (step 0: validation of the initial policy) ->
prompts -> engines generate, recording logprobs (or the next groups of `rollout.source`)
-> rewards -> TrainBatch -> (PPO: the critic's values -> GAE advantages and returns,
`ppo_step`; the critic's update runs beside the policy's) -> every rank trains on its
shard (PPO's warm-up steps: no update), checking its logprobs against
the rollout's bit for bit -> the ranks' new weights straight into every engine over the
weight group (as the worker's weight_version; the driver never holds them) -> validation
when due -> the metrics row to every tracker -> a checkpoint (weights written by rank 0).

Each concern has its own module: `actors` (start, generation, training, weight sync),
`inputs` (prompts, rewards and the validation set of the run), `step_prompts` (a step's
prompts and scorer), `rollout_source` (completions, rewards, sampling, batch),
`reward_workers`, `evaluation`, `step_metrics` (the row and its timings), `trackers`,
`preflight`, `run_dir`, `cluster`, `job_checkpoints`, `faults`, `job_reports`, `progress`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.job import cluster
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.actors import (
    RolloutActor,
    TrainerActor,
    actor_resources,
    connect_weight_sync,
    critic_values,
    describe_actors,
    generate_on_engines,
    spawn_actors,
    spawn_critics,
    start_actors,
    sync_weights,
    train_critics,
    train_on_ranks,
)
from rl_engine.executors.job.evaluation import run_if_due
from rl_engine.executors.job.faults import (
    ActorFailure,
    ActorInfo,
    JobStopped,
    StopOnSignal,
    stop_actors,
)
from rl_engine.executors.job.inputs import JobInputs, build_inputs
from rl_engine.executors.job.job_reports import after_stop_note, resume_command, write_summary
from rl_engine.executors.job.ppo_step import critic_metrics, gae_batch
from rl_engine.executors.job.preflight import validate_before_start
from rl_engine.executors.job.progress import StepProgress
from rl_engine.executors.job.rollout_source import step_sampling, train_batch
from rl_engine.executors.job.run_dir import CONFIG_SNAPSHOT, prepare_run_dir, truncate_metrics
from rl_engine.executors.job.step_metrics import StepClock, step_record
from rl_engine.executors.job.trackers import Trackers
from rl_engine.rewards import RewardFailure

__all__ = ["RolloutActor", "TrainerActor", "actor_resources", "resume_command", "run_job"]

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
        self.inputs: JobInputs | None = None

    def start(self, resume_from: ckpt.Checkpoint | None) -> None:
        """Place and spawn the actors, compare their kernel facts, then load models (and state)."""
        self.trainers, self.engines = spawn_actors(self.config, self.groups)
        self.critics = spawn_critics(self.config, self.groups)
        describe_actors(self.actors, self.run_dir)
        started = time.perf_counter()
        resume_dir = str(resume_from.deepspeed_dir) if resume_from else None
        critic_dir = str(resume_from.critic_dir) if resume_from and self.critics else None
        self.info = start_actors(
            self.trainers, self.engines, resume_dir, critics=(self.critics, critic_dir)
        )
        self.inputs = build_inputs(self.config, self.info)
        self.rollouts, self.evaluator = self.inputs.rollouts, self.inputs.evaluator
        connect_weight_sync(self.trainers, self.engines)
        if resume_from is not None:
            self.sync_weights(resume_from.weight_version)
            self.rollouts.prompts.restore(resume_from.driver, resume_from.step)
            self.last_checkpoint = resume_from
        log.info("actors ready in %.1f s", time.perf_counter() - started)

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
        """One RL step: rollout -> rewards -> batch -> train -> weight sync -> eval -> metrics -> checkpoint."""
        clock = StepClock()
        evaluation = self.evaluate(step, clock, before=True)  # the initial policy, into row 0
        with clock.phase("rollout"):  # engines + rewards, or the next groups of rollout.source
            completions, rewards, rollout_metrics = self.rollouts(
                step, lambda prompts, attempt=0: self.generate(prompts, step, clock, attempt), clock
            )
        with clock.phase("batch"):
            batch = train_batch(self.config, completions, rewards, self.info["eos_token_id"])
        critic, update = self.critic_phase(batch, completions, step, clock)
        with clock.phase("train"):  # the policy and (PPO) the critic at once
            results = train_on_ranks(
                self.trainers,
                batch if critic is None else critic["batch"],
                self.config.mini_batches_per_step,
                update=update,
                also=() if critic is None else critic["calls"],
            )
        results, critic_results = results[: len(self.trainers)], results[len(self.trainers) :]
        clock.add("train_compute", max(m.pop("time/train_compute") for m in results))
        with clock.phase("weight_sync"):  # the whole sync, senders and receivers
            # the worker's version: a skipped (non-finite) update keeps the old weights and version
            self.sync_weights(results[0]["weight_version"])
        evaluation.update(self.evaluate(step, clock, before=False))
        if critic is not None:
            figures = (critic["values"], critic["returns"], batch.response_mask)
            evaluation.update(critic_metrics(critic_results, *figures, warmup=not update))
        record = step_record(
            step, results[0], rewards, {**rollout_metrics, **evaluation}, clock.totals()
        )
        self.trackers.log(record)
        self.history.append(record)
        self.progress.update(record)
        if ckpt.due(self.config, step + 1, stop.requested):
            self.save_checkpoint(step + 1)
        return record

    def critic_phase(self, batch, completions, step: int, clock: StepClock):
        """PPO: the critic's values of the batch -> GAE advantages and returns -> the critic's
        update, started (gathered with the policy's). Returns ({batch, values, returns,
        calls} or None without a critic, whether the policy updates this step)."""
        if not self.critics:
            return None, True
        with clock.phase("critic_values"):
            values = critic_values(self.critics, batch)  # (B, T-1): V before this step's update
        batch, returns = gae_batch(self.config, batch, completions, values)
        mini = self.config.mini_batches_per_step
        calls = train_critics(self.critics, batch, returns, values, mini)
        critic = {"batch": batch, "values": values, "returns": returns, "calls": calls}
        return critic, step >= self.config.critic.warmup_steps

    def evaluate(self, step: int, clock: StepClock, *, before: bool) -> dict:
        """Validation figures due before (step 0) or after this step; {} when none is due."""
        return run_if_due(
            self.evaluator, self._generate_eval, step, clock, before=before, updates=self.version
        )

    def _generate_eval(self, prompts: list[list[int]], sampling):
        return generate_on_engines(self.engines, prompts, sampling)[0]

    def generate(self, prompts: list[list[int]], step: int, clock: StepClock, attempt: int = 0):
        sampling = step_sampling(self.config, step, self.info["eos_token_id"], attempt)
        completions, seconds = generate_on_engines(self.engines, prompts, sampling)
        clock.add("generate_compute", seconds)
        return completions

    def sync_weights(self, version: int) -> None:
        """The ranks' weights (of `version`) into every engine; nothing to do when the engines
        serve it already (a skipped update leaves the weights bitwise as they were; at the
        start, engines and ranks load the same version-0 weights)."""
        if version != self.version:
            self.version = sync_weights(self.trainers, self.engines, version)

    def save_checkpoint(self, step: int) -> None:
        self.last_checkpoint = ckpt.save(
            self.run_dir,
            self.config,
            self.trainers,
            step=step,
            weight_version=self.version,
            driver_state=self.rollouts.prompts.state(),
            critics=self.critics,
        )

    # ------------------------------------------------------------------ what the run leaves

    def after_stop_note(self) -> str:
        return after_stop_note(self.run_dir, self.last_checkpoint)

    def write_reports(self, status: str) -> None:
        write_summary(self.run_dir, self.config, status, self.history, self.actors)

    def stop_actors(self) -> None:
        stop_actors(self.actors)

    def release(self) -> None:
        if self.inputs is not None:
            self.inputs.close()
        self.stop_actors()
        cluster.release(self.groups)
