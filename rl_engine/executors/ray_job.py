"""The RL job: Ray starts N DeepSpeed ranks and M rollout engines and runs GRPO steps.

One step:  prompts -> engines generate (recording logprobs) -> task rewards (or:
the next groups of `rollout.source`, with their rewards; saved to
rollouts/step_N.jsonl with `rollout.save`; see executors/rollout_source.py) ->
TrainBatch (group-normalised advantages) -> every rank trains on its shard and
checks its logprobs against the rollout's, bit for bit -> rank 0 exports the
new weights -> engines load them (as the worker's weight_version: its optimizer updates).

The actors, their devices and how they start: `actors`. What a run leaves
(summary.json, training.png, the resume command): `job_reports`.

Around the steps: the config is validated before Ray starts (`preflight`), the run
directory is claimed (`run_dir`), actors are placed on the cluster and their kernel
facts compared (`cluster`), checkpoints are written every `checkpoint.every` steps and
at the end (`job_checkpoints`), and a dead actor or a signal ends the run cleanly with the
command that resumes it (`faults`). Wall-clock timings live under `time/` in the
metrics, so a resumed run's metrics equal an uninterrupted run's on every other key.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from rl_engine.config import RunConfig
from rl_engine.executors import cluster
from rl_engine.executors import job_checkpoints as ckpt
from rl_engine.executors.actors import (
    RolloutActor,
    TrainerActor,
    actor_resources,
    describe_actors,
    spawn_actors,
    sync_weights,
)
from rl_engine.executors.faults import (
    ActorFailure,
    ActorInfo,
    JobStopped,
    StopOnSignal,
    gather,
    stop_actors,
)
from rl_engine.executors.job_reports import after_stop_note, resume_command, write_summary
from rl_engine.executors.preflight import validate_before_start
from rl_engine.executors.progress import StepProgress
from rl_engine.executors.rollout_source import StepRollouts
from rl_engine.executors.run_dir import (
    CONFIG_SNAPSHOT,
    MetricsLog,
    prepare_run_dir,
    truncate_metrics,
)

__all__ = ["RolloutActor", "TrainerActor", "actor_resources", "resume_command", "run_job"]

log = logging.getLogger("rl_engine.job")


def _sampling(config: RunConfig, step: int, eos_token_id):
    from rl_engine.rollout import SamplingParams

    seed = config.seed * 100_003 + step
    return SamplingParams.from_config(config.rollout, seed=seed, eos_token_id=eos_token_id)


def run_job(config: RunConfig, *, resume: bool = False, overwrite: bool = False) -> list[dict]:
    """Run (or with `resume`, continue) the job in `config.output_dir`; returns every step's metrics.

    Raises JobStopped (with the exit code) when an actor fails or a signal stops the run;
    ValueError for anything wrong with the config or the run directory (before Ray starts).
    """
    validate_before_start(config)
    run_dir = prepare_run_dir(config.output_dir, resume=resume, overwrite=overwrite)
    start = ckpt.latest(run_dir) if resume else None
    if start is not None and start.weights_only:
        raise ValueError(
            f"{start.path} is a weights-only checkpoint (checkpoint.weights_only: true): it holds "
            "no optimizer state and cannot resume; export it with rl-engine export instead"
        )
    if resume and start is None:
        log.info("%s has no checkpoint yet: starting it from step 0", run_dir)
    history = truncate_metrics(run_dir, start.step if start else 0) if resume else []
    config.to_yaml(run_dir / CONFIG_SNAPSHOT)
    owns_ray = cluster.connect(config)
    job = _Job(config, run_dir, history)
    try:
        with StopOnSignal() as stop:
            job.start(start)
            job.train(stop)
        return job.history
    except ActorFailure as err:
        job.stop_actors()
        job.write_reports(status=f"failed: {err}")
        raise JobStopped(f"{err}\n{job.after_stop_note()}", 1) from None
    finally:
        job.release()
        if owns_ray:
            ray.shutdown()


class _Job:
    """The driver's state for one run: actors, task, step loop, checkpoints, reports."""

    def __init__(self, config: RunConfig, run_dir: Path, history: list[dict]):
        self.config, self.run_dir, self.history = config, run_dir, history
        self.engines: list[ActorInfo] = []
        self.trainers: list[ActorInfo] = []
        self.groups = []
        self.weights = None  # the state dict the engines serve (saved with checkpoints)
        self.version = 0
        self.last_checkpoint: ckpt.Checkpoint | None = None

    # ------------------------------------------------------------------ start

    def start(self, resume_from: ckpt.Checkpoint | None) -> None:
        """Place and spawn the actors, compare their kernel facts, then load models (and state)."""
        self.trainers, self.engines = spawn_actors(self.config, self.groups)
        describe_actors(self.trainers + self.engines, self.run_dir)
        self._load_actors(resume_from)

    def _load_actors(self, resume_from: ckpt.Checkpoint | None) -> None:
        """Models into every actor, DeepSpeed rendezvous at rank 0's node, checkpoint if resuming."""
        started = time.perf_counter()
        log.info(
            "loading the model in %d engine(s) and %d DeepSpeed rank(s); a machine's first "
            "run also builds DeepSpeed's CPU op (about a minute; `make setup` builds it ahead)",
            len(self.engines),
            len(self.trainers),
        )
        master = self.trainers[0]
        port = gather([(master, master.handle.free_port.remote())])[0]
        resume_dir = str(resume_from.deepspeed_dir) if resume_from else None
        starts = [
            (t, t.handle.start.remote(master.node_ip, port, resume_dir)) for t in self.trainers
        ]
        self.info = gather([(e, e.handle.start.remote()) for e in self.engines] + starts)[0]
        self.task = self._make_task()
        self.rollouts = StepRollouts(self.config, self.task, self.info["vocab_size"])
        if resume_from is not None:
            self.sync_weights(resume_from.weight_version)
            self.last_checkpoint = resume_from
        log.info("actors ready in %.1f s", time.perf_counter() - started)

    def _make_task(self):
        from rl_engine.tasks import make_task

        return make_task(
            self.config.rollout.task,
            vocab_size=self.info["vocab_size"],
            tokenizer=self.info["tokenizer"],
            seed=self.config.seed,
        )

    # ------------------------------------------------------------------ steps

    def train(self, stop: StopOnSignal) -> None:
        config, first = self.config, len(self.history)
        log.info(
            "job: %d trainer rank(s), %d rollout engine(s), batch_invariant=%s, steps %d..%d",
            len(self.trainers),
            len(self.engines),
            config.batch_invariant,
            first,
            config.steps - 1,
        )
        progress, metrics_log = StepProgress(config.steps, first), MetricsLog(self.run_dir)
        try:
            for step in range(first, config.steps):
                record = self.step(step)
                metrics_log.append(record)
                self.history.append(record)
                progress.update(record)
                done = step + 1
                every = config.checkpoint.every
                if done == config.steps or (every and done % every == 0) or stop.requested:
                    self.save_checkpoint(done)
                if stop.requested and done < config.steps:
                    self.write_reports(status=f"stopped by signal after step {step}")
                    raise JobStopped(
                        f"stopped after step {step}; {self.after_stop_note()}", stop.exit_code
                    )
        finally:
            progress.close()
            metrics_log.close()
        self.write_reports(status="complete")

    def step(self, step: int) -> dict:
        from rl_engine.executors.batch import TrainBatch

        config, t, generated = self.config, {}, []
        started = time.perf_counter()

        def generate(prompts):
            completions, seconds = self._generate(prompts, step)
            generated.append(seconds)
            return completions

        # engines + task rewards, or the next groups of rollout.source (then no generation)
        completions, rewards = self.rollouts(step, generate)
        t["time/rollout"] = time.perf_counter() - started
        t["time/generate_compute"] = sum(generated)
        mark = time.perf_counter()
        eos = self.info["eos_token_id"]
        batch = TrainBatch.from_completions(
            completions,
            rewards,
            samples_per_prompt=config.rollout.samples_per_prompt,
            pad_token_id=eos if isinstance(eos, int) else 0,
            normalize_std=config.algorithm.normalize_std,
        )
        t["time/batch"] = time.perf_counter() - mark
        mark = time.perf_counter()
        world = len(self.trainers)
        results = gather(
            [
                (a, a.handle.train_step.remote(batch.shard(r, world)))
                for r, a in enumerate(self.trainers)
            ]
        )
        t["time/train"] = time.perf_counter() - mark
        t["time/train_compute"] = max(m.pop("time/train_compute") for m in results)
        mark = time.perf_counter()
        # the worker's version: a skipped (non-finite) update keeps the old weights and version
        self.sync_weights(results[0]["weight_version"])
        t["time/weight_sync"] = time.perf_counter() - mark
        t["time/step"] = time.perf_counter() - started
        overhead = t["time/step"] - t["time/generate_compute"] - t["time/train_compute"]
        t["time/driver_overhead"] = overhead
        t["time/driver_overhead_fraction"] = overhead / t["time/step"]
        return {
            **results[0],
            "step": step,
            "reward_mean": sum(rewards) / len(rewards),
            **t,
        }

    def _generate(self, prompts, step: int):
        """Prompts spread over the engines; completions in prompt order, and the slowest engine's time."""
        engines = self.engines
        sampling = _sampling(self.config, step, self.info["eos_token_id"])
        shards = [list(range(i, len(prompts), len(engines))) for i in range(len(engines))]
        calls = [
            (e, e.handle.generate.remote([prompts[j] for j in idx], sampling))
            for e, idx in zip(engines, shards)
        ]
        completions, seconds = [], 0.0
        for idx, (result, spent) in zip(shards, gather(calls)):
            seconds = max(seconds, spent)
            for c in result:
                c.prompt_index = idx[c.prompt_index]
                completions.append(c)
        completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
        return completions, seconds

    def sync_weights(self, version: int) -> None:
        """Rank 0's weights into every engine as `version` (export is collective under ZeRO-3)."""
        self.weights = sync_weights(self.trainers, self.engines, version)
        self.version = version

    # ------------------------------------------------------------------ checkpoints, reports

    def save_checkpoint(self, step: int) -> None:
        started = time.perf_counter()
        weights_only = self.config.checkpoint.weights_only
        staging = ckpt.begin(self.run_dir, step)
        if not weights_only:
            target = str(staging / "deepspeed")
            gather([(a, a.handle.save_checkpoint.remote(target)) for a in self.trainers])
        ckpt.write_driver_part(
            staging,
            step=step,
            weight_version=self.version,
            weights=self.weights,
            config=self.config,
            weights_only=weights_only,
        )
        self.last_checkpoint = ckpt.commit(self.run_dir, staging, self.config.checkpoint.keep_last)
        log.info(
            "checkpoint %s written in %.1f s",
            self.last_checkpoint.path,
            time.perf_counter() - started,
        )

    def after_stop_note(self) -> str:
        return after_stop_note(self.run_dir, self.last_checkpoint)

    def write_reports(self, status: str) -> None:
        actors = self.trainers + self.engines
        write_summary(self.run_dir, self.config, status, self.history, actors)

    def stop_actors(self) -> None:
        stop_actors(self.trainers + self.engines)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.stop_actors()
        for group in self.groups:
            remove_placement_group(group)
