"""The RL job: Ray starts N DeepSpeed ranks and M rollout engines and runs GRPO steps.

One step:  prompts -> engines generate (recording logprobs) -> task rewards (or:
the next groups of `rollout.source`, with their rewards; saved to
rollouts/step_N.jsonl with `rollout.save`; see executors/rollout_source.py) ->
TrainBatch (group-normalised advantages) -> every rank trains on its shard and
checks its logprobs against the rollout's, bit for bit -> rank 0 exports the
new weights -> engines load them (weight_version = step + 1).

Devices (`config.device`): on cpu every actor asks Ray for one CPU; on cuda
each also asks for one GPU (`actor_resources`), and Ray makes it the only GPU
the actor sees. An engine moves its model there and then patches it (the
device picks the kernels: triton on cuda); a trainer rank's LOCAL_RANK is the
index of that GPU among the visible ones, and the worker uses cuda:LOCAL_RANK.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.distributed import free_port
from rl_engine.executors.rollout_source import StepRollouts
from rl_engine.io import write_json_atomic, write_text_atomic

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


@ray.remote
class RolloutActor:
    """One rollout engine in its own process."""

    def __init__(self, config: RunConfig):
        from rl_engine.models import load_model
        from rl_engine.patching import apply_batch_invariant
        from rl_engine.rollout import RolloutEngine

        model, self.tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
        device = f"cuda:{_visible_gpu_index()}" if config.device == "cuda" else "cpu"
        model.to(device)  # first move, then patch: the ops are resolved for this device
        if config.batch_invariant:
            apply_batch_invariant(model)
        self.vocab_size = model.config.vocab_size
        self.eos_token_id = model.config.eos_token_id
        self.engine = RolloutEngine(
            model, device=device, max_batch_size=config.rollout.max_batch_size
        )

    def model_info(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "tokenizer": self.tokenizer,
        }

    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)

    def load_weights(self, state_dict, version: int) -> None:
        self.engine.load_weights(state_dict, version)


@ray.remote
class TrainerActor:
    """One DeepSpeed rank."""

    def __init__(self, config: RunConfig, rank: int, world_size: int, master_port: int):
        local_rank = _visible_gpu_index() if config.device == "cuda" else rank
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
        )
        from rl_engine.executors.deepspeed_trainer import DeepSpeedTrainingWorker

        self.rank = rank
        self.worker = DeepSpeedTrainingWorker(config, device=config.device)  # cuda: LOCAL_RANK

    def train_step(self, batch) -> dict:
        return self.worker.train_step(batch)

    def export_weights(self):
        return self.worker.export_weights()

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)


def _sampling(config: RunConfig, step: int, eos_token_id):
    from rl_engine.rollout import SamplingParams

    seed = config.seed * 100_003 + step
    return SamplingParams.from_config(config.rollout, seed=seed, eos_token_id=eos_token_id)


def _generate(engines, prompts, sampling):
    """Spread prompts over the engines; return completions in prompt order with global indices."""
    shards = [list(range(i, len(prompts), len(engines))) for i in range(len(engines))]
    futures = [
        e.generate.remote([prompts[j] for j in idx], sampling) for e, idx in zip(engines, shards)
    ]
    completions = []
    for idx, result in zip(shards, ray.get(futures)):
        for c in result:
            c.prompt_index = idx[c.prompt_index]
            completions.append(c)
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    return completions


def _summary_line(step, m):
    parity = ""
    if "parity/num_tokens" in m:  # absent with parity: off
        parity = (
            f" | parity exact {m['parity/exact_match_fraction']:.4f} "
            f"(max |dlogp| {m['parity/max_abs_diff']:.2e}, {m['parity/num_tokens']} tok)"
        )
    skipped = f" | update SKIPPED ({m['skip_reason']})" if m.get("skipped_update") else ""
    return (
        f"step {step:>3} | reward {m['reward_mean']:.3f}{parity} | loss {m['loss']:+.4f} "
        f"| kl {m['kl']:.2e} | {m['step_seconds']:.1f}s{skipped}"
    )


def run_job(config: RunConfig) -> list[dict]:
    """Run `config.steps` GRPO steps; write metrics.jsonl, summary.json and plots to output_dir."""
    from rl_engine.executors.batch import TrainBatch
    from rl_engine.tasks import make_task

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started_ray = not ray.is_initialized()
    if started_ray:
        runtime_env = {"env_vars": {"DS_ACCELERATOR": _ds_accelerator(config)}}
        if os.environ.get("RAY_ADDRESS"):  # `ray job submit`: join the cluster it names
            ray.init(log_to_driver=True, runtime_env=runtime_env)
        else:  # a private local cluster, never one another process started on this machine
            ray.init(
                address="local",
                num_cpus=config.trainer.num_ranks + config.rollout.num_engines,
                include_dashboard=False,
                log_to_driver=True,
                runtime_env=runtime_env,
            )
    try:
        resources = actor_resources(config)
        engines = [
            RolloutActor.options(**resources).remote(config)
            for _ in range(config.rollout.num_engines)
        ]
        port = free_port()
        trainers = [
            TrainerActor.options(**resources).remote(config, rank, config.trainer.num_ranks, port)
            for rank in range(config.trainer.num_ranks)
        ]
        info = ray.get(engines[0].model_info.remote())
        task = make_task(
            config.rollout.task,
            vocab_size=info["vocab_size"],
            tokenizer=info["tokenizer"],
            seed=config.seed,
        )
        pad_id = info["eos_token_id"] if isinstance(info["eos_token_id"], int) else 0
        rollouts = StepRollouts(config, task, info["vocab_size"])  # engines, or rollout.source
        history = []
        log.info(
            "job: %d trainer rank(s), %d rollout engine(s), batch_invariant=%s, %d steps",
            len(trainers),
            len(engines),
            config.batch_invariant,
            config.steps,
        )
        for step in range(config.steps):
            started = time.perf_counter()
            sampling = _sampling(config, step, info["eos_token_id"])
            completions, rewards = rollouts(step, partial(_generate, engines, sampling=sampling))
            batch = TrainBatch.from_completions(
                completions,
                rewards,
                samples_per_prompt=config.rollout.samples_per_prompt,
                pad_token_id=pad_id,
                normalize_std=config.algorithm.normalize_std,
            )
            world = len(trainers)
            metrics = ray.get(
                [t.train_step.remote(batch.shard(r, world)) for r, t in enumerate(trainers)]
            )[0]
            # export_weights is collective under ZeRO-3: every rank gathers, rank 0 returns the dict
            state = ray.get([t.export_weights.remote() for t in trainers])[0]
            # the worker's version: a skipped update keeps the old weights and version
            ray.get([e.load_weights.remote(state, metrics["weight_version"]) for e in engines])
            metrics = {
                **metrics,
                "step": step,
                "reward_mean": sum(rewards) / len(rewards),
                "step_seconds": time.perf_counter() - started,
            }
            history.append(metrics)
            log.info(_summary_line(step, metrics))
            write_text_atomic(out / "metrics.jsonl", "".join(_jsonl(m) for m in history))
        ray.get([t.save_checkpoint.remote(str(out / "checkpoint")) for t in trainers])
        write_json_atomic(out / "summary.json", {"config": asdict(config), "steps": history})
        _plot(history, out / "training.png")
        return history
    finally:
        if started_ray:
            ray.shutdown()


def _ds_accelerator(config: RunConfig) -> str:
    """DeepSpeed's accelerator for the trainer actors: cuda on cuda, else the caller's (cpu)."""
    return "cuda" if config.device == "cuda" else os.environ.get("DS_ACCELERATOR", "cpu")


def _jsonl(m: dict) -> str:
    import json

    return json.dumps(m, sort_keys=True, default=float) + "\n"


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
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
