"""The job's Ray actors: a rollout engine or a DeepSpeed trainer rank each, and how they start.

Devices (`config.device`): on cpu every actor asks Ray for one CPU; on cuda
each also asks for one GPU (`actor_resources`), and Ray makes it the only GPU
the actor sees. An engine moves its model there and then patches it (the
device picks the kernels: triton on cuda); a trainer rank's LOCAL_RANK is the
index of that GPU among the visible ones, and the worker uses cuda:LOCAL_RANK.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from pathlib import Path

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.job import cluster
from rl_engine.executors.job.faults import (
    ActorFailure,
    ActorInfo,
    first_line,
    gather,
    weight_sync_kill_switch,
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


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_free_heap() -> None:
    """Hand glibc's free heap pages back to the OS (`malloc_trim(0)`).

    Tensors up to glibc's mmap threshold (up to 32 MiB) come from its heap, and freed
    ones stay resident there. An actor calls this after each phase (loading, generating,
    training, a sync): an engine's generation and the ranks' training never run at once,
    so memory one of them holds only for its own phase should not sit idle through the
    other's (measured: 420 MiB per ZeRO-3 rank of the 0.5B-shaped job after loading).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _quiet_model_loading() -> None:
    """Model-loading chatter (transformers, GGUF dequantisation bars, DeepSpeed info) off in actors."""
    from rl_engine.models import quiet_loading

    quiet_loading()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


@ray.remote
class RolloutActor:
    """One rollout engine in its own process, or one rank of a tensor-parallel engine
    (`rollout.tensor_parallel_size` > 1: its ranks join their own gloo / NCCL group at
    `start`); `start` loads the model."""

    def __init__(self, config: RunConfig, index: int = 0, tp_rank: int = 0):
        self.config, self.index, self.tp_rank = config, index, tp_rank
        self.receiver = self.group = None

    def describe(self) -> dict:
        return {
            **cluster.node_identity(),
            "facts": cluster.kernel_facts(self.config.device),
        }

    def free_port(self) -> int:
        """A port free on this node: the TP group's rendezvous when this is TP rank 0."""
        from rl_engine.executors.worker.distributed import free_port

        return free_port(host="")

    def start(self, tp_address: str | None = None, tp_port: int | None = None) -> dict:
        from rl_engine.models import has_safetensors, load_model
        from rl_engine.patching import apply_batch_invariant
        from rl_engine.rollout import RolloutEngine

        _quiet_model_loading()
        config = self.config
        device, batch = _actor_device(config), config.rollout.max_batch_size
        if config.rollout.tensor_parallel_size > 1:
            self._join_tp_group(device, tp_address, tp_port)
        if config.rollout.tensor_parallel_size > 1 and has_safetensors(config.model):
            from rl_engine.rollout.tp.engine import engine_from_folder

            # this rank reads only its rows of the folder's weights
            self.engine, tokenizer = engine_from_folder(
                config.model,
                dtype=config.torch_dtype,
                device=device,
                patch=config.batch_invariant,
                max_batch_size=batch,
            )
            model = self.engine.model
        else:
            model, tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
            model.to(device)  # first move, then patch: the ops are resolved for this device
            if config.batch_invariant:
                apply_batch_invariant(model)
            if config.rollout.tensor_parallel_size > 1:
                from rl_engine.rollout.tp import TensorParallelEngine

                self.engine = TensorParallelEngine(model, device=device, max_batch_size=batch)
            else:
                self.engine = RolloutEngine(model, device=device, max_batch_size=batch)
        release_free_heap()
        return {
            "vocab_size": model.config.vocab_size,
            "eos_token_id": model.config.eos_token_id,
            "tokenizer": tokenizer,
        }

    def _join_tp_group(self, device: str, address: str, port: int) -> None:
        """The engine's TP ranks' process group: this process's default group."""
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            init_method=f"tcp://{address}:{port}",
            rank=self.tp_rank,
            world_size=self.config.rollout.tensor_parallel_size,
            timeout=timedelta(seconds=self.config.trainer.collective_timeout_s),
        )

    def generate(self, prompts, sampling):
        """(completions, seconds spent generating)."""
        started = time.perf_counter()
        completions = self.engine.generate(prompts, sampling, progress=False)
        seconds = time.perf_counter() - started
        release_free_heap()
        return completions, seconds

    def weight_plan(self, manifest, receiver: int):
        """Check the trainer ranks' manifest against this engine's model (ValueError naming the
        key); what this process (receiver `receiver` of the sync) receives of every sync:
        everything, or a TP rank's own shards."""
        self.receiver = self.engine.weight_receiver(
            manifest,
            receiver=receiver,
            bucket_bytes=self.config.trainer.weight_sync_bucket_bytes,
        )
        return self.receiver.plan

    def connect_weight_group(self, address: str, port: int, rank: int, size: int) -> None:
        from rl_engine.executors.worker.weight_transport import WeightGroup

        if self.group is not None:
            self.group.close()
        timeout = self.config.trainer.collective_timeout_s
        self.group = WeightGroup.connect(
            address, port, rank, size, self.engine.device.type, timeout
        )

    def receive_weights(self) -> int:
        """One weight sync from the trainer ranks, in place; returns the version now served."""
        hook = weight_sync_kill_switch(f"rollout engine {self.index}")
        return self.engine.receive_weights(self.receiver, self.group, on_bucket=hook)


class _DeepSpeedRank:
    """What the policy's and the critic's DeepSpeed ranks share: identity, kernel facts, a port."""

    def __init__(self, config: RunConfig, rank: int, world_size: int):
        self.config, self.rank, self.world_size = config, rank, world_size

    def describe(self) -> dict:
        return {
            **cluster.node_identity(),
            "facts": cluster.kernel_facts(self.config.device),
        }

    def free_port(self) -> int:
        """A port free on every interface of this rank's node: its group's MASTER_PORT on rank 0."""
        from rl_engine.executors.worker.distributed import free_port

        return free_port(host="")


@ray.remote
class TrainerActor(_DeepSpeedRank):
    """One DeepSpeed rank; `start` joins the process group and builds the worker."""

    def start(self, master_addr: str, master_port: int, resume_from: str | None) -> None:
        _join_process_group(self.config, self.rank, self.world_size, master_addr, master_port)
        from rl_engine.executors.worker.deepspeed_trainer import DeepSpeedTrainingWorker

        self.worker = DeepSpeedTrainingWorker(
            self.config, device=self.config.device
        )  # cuda: LOCAL_RANK
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        release_free_heap()

    def train_step(self, batch, update: bool = True) -> dict:
        started = time.perf_counter()
        metrics = self._collective("train_step", self.worker.train_step, batch, update=update)
        seconds = time.perf_counter() - started
        release_free_heap()
        return {**metrics, "time/train_compute": seconds}

    def weight_manifest(self):
        return self.worker.weight_manifest()

    def connect_weight_group(self, address: str, port: int, size: int, plans: list) -> None:
        self._collective(
            "connect_weight_sync", self.worker.connect_weight_sync, address, port, size, plans
        )

    def send_weights(self) -> dict:
        hook = weight_sync_kill_switch(f"trainer rank {self.rank}")
        return self._collective("send_weights", self.worker.send_weights, on_bucket=hook)

    def save_checkpoint(self, directory: str | None, weights_path: str) -> None:
        """The policy's weights file (written by rank 0) and, unless `directory` is None, the
        DeepSpeed checkpoint of every rank under it; collective."""
        self._collective("save_weights", self.worker.save_weights, weights_path)
        if directory is not None:
            self._collective("save_checkpoint", self.worker.save_checkpoint, directory, tag="state")
        release_free_heap()

    def load_checkpoint(self, directory: str) -> None:
        self._collective("load_checkpoint", self.worker.load_checkpoint, directory)

    def compute_logprobs(self, batch):
        return self._collective("compute_logprobs", self.worker.compute_logprobs, batch)

    def _collective(self, what: str, fn, *args, **kwargs):
        return _collective(f"trainer rank {self.rank}", self.config, what, fn, *args, **kwargs)


def _join_process_group(config: RunConfig, rank: int, world_size: int, addr: str, port: int):
    """This actor as rank `rank` of a DeepSpeed world (the trainer's, or the critic's own)."""
    from datetime import timedelta

    cuda = config.device == "cuda"
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(_visible_gpu_index() if cuda else rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    _quiet_model_loading()
    import deepspeed

    # Joined here so that every collective of the worker fails after the timeout instead of hanging.
    deepspeed.init_distributed(
        dist_backend="nccl" if cuda else "gloo",
        timeout=timedelta(seconds=config.trainer.collective_timeout_s),
    )


def _collective(who: str, config: RunConfig, what: str, fn, *args, **kwargs):
    """Run a worker call; a collective that timed out becomes a TimeoutError that says so."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as err:
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            raise
        limit = config.trainer.collective_timeout_s
        raise TimeoutError(
            f"{who}: {what} waited more than trainer.collective_timeout_s = "
            f"{limit:g} s in a collective for the other ranks ({first_line(str(err))})"
        ) from None


@ray.remote
class CriticActor(_DeepSpeedRank):
    """One DeepSpeed rank of PPO's critic, in the critic's own process group."""

    def start(self, master_addr: str, master_port: int, resume_from: str | None) -> None:
        _join_process_group(self.config, self.rank, self.world_size, master_addr, master_port)
        from rl_engine.executors.worker.critic import CriticWorker

        self.worker = CriticWorker(self.config, device=self.config.device)
        if resume_from is not None:
            self._collective("load_checkpoint", self.worker.load_checkpoint, resume_from)
        release_free_heap()

    def values(self, batch):
        return self._collective("values", self.worker.values, batch)

    def train_step(self, batch, returns, old_values) -> dict:
        metrics = self._collective("train_step", self.worker.train_step, batch, returns, old_values)
        release_free_heap()
        return metrics

    def save_checkpoint(self, directory: str) -> None:
        self._collective("save_checkpoint", self.worker.save_checkpoint, directory)
        release_free_heap()

    def _collective(self, what: str, fn, *args, **kwargs):
        return _collective(f"critic rank {self.rank}", self.config, what, fn, *args, **kwargs)


def spawn_actors(config: RunConfig, groups: list) -> tuple[list[ActorInfo], list[ActorInfo]]:
    """(trainer ranks, rollout engines) in one placement group per role.

    Each group is appended to `groups` as soon as it is reserved, so that the caller
    releases it even when a later one fails. The actors start empty (nothing heavy
    before the kernel checks).
    """
    n_ranks, n_engines = config.trainer.num_ranks, config.rollout.num_engines
    tp = config.rollout.tensor_parallel_size
    resources = actor_resources(config)
    rank_group = cluster.reserve("trainer", n_ranks, config.trainer.placement, resources)
    groups.append(rank_group)
    # every process of every engine: one bundle each, engine e's TP ranks at e * tp + r
    engine_group = cluster.reserve("rollout", n_engines * tp, config.rollout.placement, resources)
    groups.append(engine_group)
    options = dict(
        **resources,
        runtime_env={"env_vars": cluster.actor_env(_ds_accelerator(config))},
        max_restarts=0,
    )
    trainers = [
        ActorInfo(
            "trainer rank",
            r,
            TrainerActor.options(
                **options, scheduling_strategy=cluster.in_group(rank_group, r)
            ).remote(config, r, n_ranks),
        )
        for r in range(n_ranks)
    ]
    engines = [
        ActorInfo(
            "rollout engine",
            e,
            RolloutActor.options(
                **options, scheduling_strategy=cluster.in_group(engine_group, e * tp + r)
            ).remote(config, e, r),
            tp_rank=r if tp > 1 else None,
        )
        for e in range(n_engines)
        for r in range(tp)
    ]
    return trainers, engines


def spawn_critics(config: RunConfig, groups: list) -> list[ActorInfo]:
    """PPO's critic ranks ("critic rank N") in a placement group of their own (none without ppo);
    they go where the trainer ranks' placement says."""
    if config.algorithm.name != "ppo":
        return []
    n_ranks, resources = config.critic_ranks, actor_resources(config)
    group = cluster.reserve("critic", n_ranks, config.trainer.placement, resources)
    groups.append(group)
    env = {"env_vars": cluster.actor_env(_ds_accelerator(config))}
    return [
        ActorInfo(
            "critic rank",
            r,
            CriticActor.options(
                **resources,
                runtime_env=env,
                max_restarts=0,
                scheduling_strategy=cluster.in_group(group, r),
            ).remote(config, r, n_ranks),
        )
        for r in range(n_ranks)
    ]


def start_critics(critics: list[ActorInfo], resume_dir: str | None) -> list:
    """The critic ranks' remote start calls (their own rendezvous at critic rank 0's node);
    the caller gathers them with the other actors' starts."""
    if not critics:
        return []
    lead = critics[0]
    port = gather([(lead, lead.handle.free_port.remote())])[0]
    return [(c, c.handle.start.remote(lead.node_ip, port, resume_dir)) for c in critics]


def critic_values(critics: list[ActorInfo], batch):
    """(B, T-1) fp32 values of the whole batch: each critic rank scores its contiguous shard."""
    import torch

    world = len(critics)
    calls = [(c, c.handle.values.remote(batch.shard(r, world))) for r, c in enumerate(critics)]
    return torch.cat(gather(calls))


def train_critics(critics: list[ActorInfo], batch, returns, old_values, mini_batches: int):
    """Remote critic updates (each rank its rows of each mini-batch, with their returns and
    values); the caller gathers them. Returns the (actor, ref) calls."""
    world, calls = len(critics), []
    for r, c in enumerate(critics):
        rows = batch.shard_rows(r, world, mini_batches)
        shard = batch.shard(r, world, mini_batches)
        calls.append((c, c.handle.train_step.remote(shard, returns[rows], old_values[rows])))
    return calls


def start_actors(
    trainers: list[ActorInfo],
    engines: list[ActorInfo],
    resume_dir: str | None,
    critics: tuple[list[ActorInfo], str | None] = ([], None),
) -> dict:
    """Models into every actor, DeepSpeed's rendezvous at rank 0's node (and its state when resuming).

    `critics`: PPO's critic ranks and the folder of their checkpoint when resuming.
    Returns the engines' model facts (vocab_size, eos_token_id, tokenizer).
    """
    log.info(
        "loading the model in %d engine(s) and %d DeepSpeed rank(s); a machine's first "
        "run also builds DeepSpeed's CPU op (about a minute; `make setup` builds it ahead)",
        len(engines),
        len(trainers),
    )
    master = trainers[0]
    port = gather([(master, master.handle.free_port.remote())])[0]
    starts = [(t, t.handle.start.remote(master.node_ip, port, resume_dir)) for t in trainers]
    starts += start_critics(*critics)
    return gather(_engine_starts(engines) + starts)[0]


def _engine_starts(engines: list[ActorInfo]) -> list:
    """start() of every engine process; a TP engine's ranks meet at its TP rank 0's node."""
    leads = [e for e in engines if not e.tp_rank]
    ports = gather([(e, e.handle.free_port.remote()) for e in leads if e.tp_rank is not None])
    rendezvous = {
        e.rank: (e.node_ip, p) for e, p in zip((e for e in leads if e.tp_rank == 0), ports)
    }
    return [
        (e, e.handle.start.remote(*rendezvous[e.rank]))
        if e.tp_rank is not None
        else (e, e.handle.start.remote())
        for e in engines
    ]


def engine_leads(engines: list[ActorInfo]) -> list[ActorInfo]:
    """One process per engine (its TP rank 0): the engines as the driver counts them."""
    return [e for e in engines if not e.tp_rank]


def generate_on_engines(engines: list[ActorInfo], prompts: list[list[int]], sampling):
    """Prompts spread over the engines: (completions in prompt order, the slowest engine's
    seconds). Every TP rank of an engine gets its engine's prompts; its rank 0 answers."""
    count = len(engine_leads(engines))
    shards = [list(range(i, len(prompts), count)) for i in range(count)]
    calls = [
        (e, e.handle.generate.remote([prompts[j] for j in shards[e.rank]], sampling))
        for e in engines
    ]
    answers = [answer for e, answer in zip(engines, gather(calls)) if not e.tp_rank]
    completions, seconds = [], 0.0
    for idx, (result, spent) in zip(shards, answers):
        seconds = max(seconds, spent)
        for c in result:
            c.prompt_index = idx[c.prompt_index]
            completions.append(c)
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    return completions, seconds


def train_on_ranks(
    trainers: list[ActorInfo], batch, mini_batches: int = 1, *, update: bool = True, also=()
) -> list[dict]:
    """Every rank trains on its shard of `batch` (its rows of each of the step's
    `mini_batches`; `update=False`: parity forward only, the critic warm-up); their metrics
    (all-reduced), rank 0 first. `also`: more (actor, ref) calls gathered with them (the
    critic's update runs at the same time), their results after the ranks'."""
    world = len(trainers)
    return gather(
        [
            (a, a.handle.train_step.remote(batch.shard(r, world, mini_batches), update))
            for r, a in enumerate(trainers)
        ]
        + list(also)
    )


def connect_weight_sync(trainers: list[ActorInfo], engines: list[ActorInfo]) -> None:
    """The weight group: rank 0's manifest checked by every engine (a mismatch names the key),
    then every rank and engine joins one process group (its store on rank 0's node)."""
    lead = trainers[0]
    manifest = gather([(lead, lead.handle.weight_manifest.remote())])[0]
    # every engine process is a receiver (a TP rank's plan holds only its shards)
    plans = gather([(e, e.handle.weight_plan.remote(manifest, i)) for i, e in enumerate(engines)])
    port = gather([(lead, lead.handle.free_port.remote())])[0]
    size, first = len(trainers) + len(engines), len(trainers)
    address = lead.node_ip
    gather(
        [(t, t.handle.connect_weight_group.remote(address, port, size, plans)) for t in trainers]
        + [
            (e, e.handle.connect_weight_group.remote(address, port, first + i, size))
            for i, e in enumerate(engines)
        ]
    )
    log.info(
        "weight group: %d trainer rank(s) -> %d engine process(es), %.1f MiB a sync",
        len(trainers),
        len(engines),
        manifest.nbytes / 2**20,
    )


def sync_weights(trainers: list[ActorInfo], engines: list[ActorInfo], expected: int) -> int:
    """The trainer ranks' current weights (version `expected`) straight into every engine (the
    driver holds none); returns the version the engines now serve. An actor's death names the
    sync it happened in."""
    calls = [(t, t.handle.send_weights.remote()) for t in trainers]
    calls += [(e, e.handle.receive_weights.remote()) for e in engines]
    try:
        results = gather(calls)
    except ActorFailure as err:
        raise ActorFailure(f"{err} (in the weight sync to version {expected})") from None
    version = int(results[0]["weight_version"])
    if version != expected:
        raise RuntimeError(f"the ranks sent weight version {version}, not {expected}")
    served = results[len(trainers) :]
    if any(v != version for v in served):
        raise RuntimeError(f"engines serve versions {served} after a sync of version {version}")
    return version


def describe_actors(actors: list[ActorInfo], run_dir: Path) -> None:
    """Each actor's node, pid and kernel facts into RUN_DIR/actors.json and the log; all must match."""
    for actor, facts in zip(actors, gather([(a, a.handle.describe.remote()) for a in actors])):
        actor.node_ip, actor.node_id, actor.pid = (
            facts["node_ip"],
            facts["node_id"],
            facts["pid"],
        )
        actor.facts = facts["facts"]
    write_json_atomic(run_dir / "actors.json", [a.as_dict() for a in actors])
    for actor in actors:
        log.info("%s", actor.describe())
    cluster.check_same_kernels({a.describe(): a.facts for a in actors})
