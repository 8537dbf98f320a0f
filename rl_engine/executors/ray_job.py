"""The RL job: Ray starts N DeepSpeed ranks and M rollout engines and runs GRPO steps.

One step:  prompts -> engines generate (recording logprobs) -> task rewards (or:
the next groups of `rollout.source`, with their rewards; saved to
rollouts/step_N.jsonl with `rollout.save`; see executors/rollout_source.py) ->
TrainBatch (group-normalised advantages) -> every rank trains on its shard and
checks its logprobs against the rollout's, bit for bit -> rank 0 exports the
new weights -> engines load them (as the worker's weight_version: its optimizer updates).

Devices (`config.device`): on cpu every actor asks Ray for one CPU; on cuda
each also asks for one GPU (`actor_resources`), and Ray makes it the only GPU
the actor sees. An engine moves its model there and then patches it (the
device picks the kernels: triton on cuda); a trainer rank's LOCAL_RANK is the
index of that GPU among the visible ones, and the worker uses cuda:LOCAL_RANK.

Around the steps: the config is validated before Ray starts (`preflight`), the run
directory is claimed (`run_dir`), actors are placed on the cluster and their kernel
facts compared (`cluster`), checkpoints are written every `checkpoint.every` steps and
at the end (`job_checkpoints`), and a dead actor or a signal ends the run cleanly with the
command that resumes it (`faults`). Wall-clock timings live under `time/` in the
metrics, so a resumed run's metrics equal an uninterrupted run's on every other key.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path

import ray

from rl_engine.config import RunConfig
from rl_engine.executors import cluster
from rl_engine.executors import job_checkpoints as ckpt
from rl_engine.executors.faults import (
    ActorFailure,
    ActorInfo,
    JobStopped,
    StopOnSignal,
    first_line,
    gather,
    stop_actors,
)
from rl_engine.executors.preflight import validate_before_start
from rl_engine.executors.progress import StepProgress
from rl_engine.executors.rollout_source import StepRollouts
from rl_engine.executors.run_dir import (
    CONFIG_SNAPSHOT,
    MetricsLog,
    prepare_run_dir,
    truncate_metrics,
)
from rl_engine.io import write_json_atomic

log = logging.getLogger("rl_engine.job")


def actor_resources(config: RunConfig) -> dict:
    """Ray resources of one rollout engine or trainer rank: one CPU, and one GPU on cuda."""
    return {"num_cpus": 1, "num_gpus": 1 if config.device == "cuda" else 0}


def _visible_gpu_index() -> int:
    """Index, among the GPUs this process sees, of the one Ray assigned to this actor."""
    assigned = [str(i) for i in ray.get_gpu_ids()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if not assigned:
        raise RuntimeError("device is cuda but Ray assigned this actor no GPU")
    return visible.index(assigned[0]) if assigned[0] in visible else 0


def _actor_device(config: RunConfig) -> str:
    """cuda:<the GPU Ray assigned> on cuda, else cpu."""
    return f"cuda:{_visible_gpu_index()}" if config.device == "cuda" else "cpu"


def _ds_accelerator(config: RunConfig) -> str:
    """DeepSpeed's accelerator for the trainer actors: cuda on cuda, else the caller's (cpu)."""
    return "cuda" if config.device == "cuda" else os.environ.get("DS_ACCELERATOR", "cpu")


def _quiet_model_loading() -> None:
    """Model-loading chatter (transformers, GGUF dequantisation bars, DeepSpeed info) off in actors."""
    from rl_engine.models import quiet_loading

    quiet_loading()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


@ray.remote
class RolloutActor:
    """One rollout engine in its own process; `start` loads the model."""

    def __init__(self, config: RunConfig):
        self.config = config

    def describe(self) -> dict:
        return {
            **cluster.node_identity(),
            "facts": cluster.kernel_facts(self.config.device),
        }

    def start(self) -> dict:
        from rl_engine.models import load_model
        from rl_engine.patching import apply_batch_invariant
        from rl_engine.rollout import RolloutEngine

        _quiet_model_loading()
        config = self.config
        model, tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
        device = _actor_device(config)
        model.to(device)  # first move, then patch: the ops are resolved for this device
        if config.batch_invariant:
            apply_batch_invariant(model)
        self.engine = RolloutEngine(
            model, device=device, max_batch_size=config.rollout.max_batch_size
        )
        return {
            "vocab_size": model.config.vocab_size,
            "eos_token_id": model.config.eos_token_id,
            "tokenizer": tokenizer,
        }

    def generate(self, prompts, sampling):
        """(completions, seconds spent generating)."""
        started = time.perf_counter()
        completions = self.engine.generate(prompts, sampling, progress=False)
        return completions, time.perf_counter() - started

    def load_weights(self, state_dict, version: int) -> None:
        self.engine.load_weights(state_dict, version)


@ray.remote
class TrainerActor:
    """One DeepSpeed rank; `start` joins the process group and builds the worker."""

    def __init__(self, config: RunConfig, rank: int, world_size: int):
        self.config, self.rank, self.world_size = config, rank, world_size

    def describe(self) -> dict:
        return {
            **cluster.node_identity(),
            "facts": cluster.kernel_facts(self.config.device),
        }

    def free_port(self) -> int:
        """A port free on every interface of this rank's node: MASTER_PORT when this is rank 0."""
        from rl_engine.executors.distributed import free_port

        return free_port(host="")

    def start(self, master_addr: str, master_port: int, resume_from: str | None) -> None:
        from datetime import timedelta

        cuda = self.config.device == "cuda"
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(_visible_gpu_index() if cuda else self.rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        _quiet_model_loading()
        import deepspeed

        from rl_engine.executors.deepspeed_trainer import DeepSpeedTrainingWorker

        # Joined here so that every collective of the worker fails after the timeout instead of hanging.
        deepspeed.init_distributed(
            dist_backend="nccl" if cuda else "gloo",
            timeout=timedelta(seconds=self.config.trainer.collective_timeout_s),
        )
        self.worker = DeepSpeedTrainingWorker(
            self.config, device=self.config.device
        )  # cuda: LOCAL_RANK
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    def train_step(self, batch) -> dict:
        started = time.perf_counter()
        metrics = self._collective("train_step", self.worker.train_step, batch)
        return {**metrics, "time/train_compute": time.perf_counter() - started}

    def export_weights(self):
        return self._collective("export_weights", self.worker.export_weights)

    def save_checkpoint(self, directory: str) -> None:
        self._collective("save_checkpoint", self.worker.save_checkpoint, directory, tag="state")

    def load_checkpoint(self, directory: str) -> None:
        self._collective("load_checkpoint", self.worker.load_checkpoint, directory)

    def compute_logprobs(self, batch):
        return self._collective("compute_logprobs", self.worker.compute_logprobs, batch)

    def _collective(self, what: str, fn, *args, **kwargs):
        """Run a worker call; a collective that timed out becomes a TimeoutError that says so."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            limit = self.config.trainer.collective_timeout_s
            raise TimeoutError(
                f"trainer rank {self.rank}: {what} waited more than trainer.collective_timeout_s = "
                f"{limit:g} s in a collective for the other ranks ({first_line(str(err))})"
            ) from None


def _sampling(config: RunConfig, step: int, eos_token_id):
    from rl_engine.rollout import SamplingParams

    seed = config.seed * 100_003 + step
    return SamplingParams.from_config(config.rollout, seed=seed, eos_token_id=eos_token_id)


def resume_command(run_dir: Path) -> str:
    return f"rl-engine train --resume {shlex.quote(str(run_dir))}"


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
        self._spawn_actors()
        self._describe_actors()
        self._load_actors(resume_from)

    def _spawn_actors(self) -> None:
        """One placement group per role; the actors start empty (nothing heavy before the checks)."""
        config = self.config
        n_ranks, n_engines = config.trainer.num_ranks, config.rollout.num_engines
        resources = actor_resources(config)
        ranks = cluster.reserve("trainer", n_ranks, config.trainer.placement, resources)
        self.groups.append(ranks)
        engines = cluster.reserve("rollout", n_engines, config.rollout.placement, resources)
        self.groups.append(engines)
        options = dict(
            **resources,
            runtime_env={"env_vars": cluster.actor_env(_ds_accelerator(config))},
            max_restarts=0,
        )
        self.trainers = [
            ActorInfo(
                "trainer rank",
                r,
                TrainerActor.options(
                    **options, scheduling_strategy=cluster.in_group(ranks, r)
                ).remote(config, r, n_ranks),
            )
            for r in range(n_ranks)
        ]
        self.engines = [
            ActorInfo(
                "rollout engine",
                e,
                RolloutActor.options(
                    **options, scheduling_strategy=cluster.in_group(engines, e)
                ).remote(config),
            )
            for e in range(n_engines)
        ]

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

    def _describe_actors(self) -> None:
        actors = self.trainers + self.engines
        for actor, facts in zip(actors, gather([(a, a.handle.describe.remote()) for a in actors])):
            actor.node_ip, actor.node_id, actor.pid = (
                facts["node_ip"],
                facts["node_id"],
                facts["pid"],
            )
            actor.facts = facts["facts"]
        write_json_atomic(self.run_dir / "actors.json", [a.as_dict() for a in actors])
        for actor in actors:
            log.info("%s", actor.describe())
        cluster.check_same_kernels({a.describe(): a.facts for a in actors})

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
        self.weights = gather([(a, a.handle.export_weights.remote()) for a in self.trainers])[0]
        ref = ray.put(self.weights)
        gather([(e, e.handle.load_weights.remote(ref, version)) for e in self.engines])
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
        if self.last_checkpoint is None:
            return (
                f"no checkpoint was written yet; resume starts over: {resume_command(self.run_dir)}"
            )
        return (
            f"last checkpoint {self.last_checkpoint.path.name} is intact; resume with: "
            f"{resume_command(self.run_dir)}"
        )

    def write_reports(self, status: str) -> None:
        summary = {"config": asdict(self.config), "status": status, "steps": self.history}
        summary["actors"] = [a.as_dict() for a in self.trainers + self.engines]
        write_json_atomic(self.run_dir / "summary.json", summary)
        if self.history:
            _plot(self.history, self.run_dir / "training.png")

    def stop_actors(self) -> None:
        stop_actors(self.trainers + self.engines)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.stop_actors()
        for group in self.groups:
            remove_placement_group(group)


def _plot(history: list[dict], path: Path) -> None:
    """Reward and parity per step (a picture of the run); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no training.png (pip install matplotlib)")
        return
    steps = [m["step"] for m in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [m["reward_mean"] for m in history], marker="o")
    ax1.set(title="mean reward", xlabel="step")
    if all("parity/exact_match_fraction" in m for m in history):
        ax2.plot(
            steps,
            [m["parity/exact_match_fraction"] for m in history],
            marker="o",
            label="exact-match fraction",
        )
        ax2.legend(loc="lower right")
    ax2.set(title="trainer == rollout (bitwise)", xlabel="step", ylim=(-0.05, 1.05))
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
