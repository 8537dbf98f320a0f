"""Placing, spawning and starting the job's actors, and the kernel-parity precondition.

At the job's start, in this order: `spawn_actors` / `spawn_critics` (a placement group per
role, empty actors: nothing heavy before the kernel check) -> `describe_actors` (node, pid
and kernel facts of each, into RUN_DIR/actors.json) -> `check_kernel_parity` (every actor
must compute with the same kernels, or the job refuses to start) -> `start_actors` (models
into every actor, DeepSpeed's rendezvous, a checkpoint's state when resuming).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rl_engine.base.io import write_json_atomic
from rl_engine.config import RunConfig
from rl_engine.executors.job import cluster
from rl_engine.executors.job.actors.process import ds_accelerator
from rl_engine.executors.job.actors.rollout import RolloutActor
from rl_engine.executors.job.actors.trainers import CriticActor, TrainerActor
from rl_engine.executors.job.actors.vllm_rollout import VllmRolloutActor
from rl_engine.executors.job.faults import ActorInfo, gather

log = logging.getLogger("rl_engine.job")


def actor_resources(config: RunConfig) -> dict:
    """Ray resources of one rollout engine or trainer rank: one CPU, and one GPU on cuda."""
    return {"num_cpus": 1, "num_gpus": 1 if config.device == "cuda" else 0}


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
    options, env = dict(**resources, max_restarts=0), cluster.actor_env(ds_accelerator(config))
    trainers = [
        ActorInfo(
            "trainer rank",
            r,
            TrainerActor.options(
                **options, scheduling_strategy=cluster.in_group(rank_group, r)
            ).remote(config, r, n_ranks, env=env),
        )
        for r in range(n_ranks)
    ]
    engine_class, engine_env = engine_actor(config, env)
    engines = [
        ActorInfo(
            "rollout engine",
            e,
            engine_class.options(
                **options, scheduling_strategy=cluster.in_group(engine_group, e * tp + r)
            ).remote(config, e, r, env=engine_env),
            tp_rank=r if tp > 1 else None,
        )
        for e in range(n_engines)
        for r in range(tp)
    ]
    return trainers, engines


def engine_actor(config: RunConfig, env: dict[str, str]):
    """The rollout engines' actor class and environment: the own engine's, or vLLM's
    (rollout.engine: vllm) with the settings its process needs before vLLM is imported."""
    if config.rollout.engine != "vllm":
        return RolloutActor, env
    from rl_engine.rollout.vllm.engine import ENGINE_ENV

    return VllmRolloutActor, {**env, **ENGINE_ENV}


def spawn_critics(config: RunConfig, groups: list) -> list[ActorInfo]:
    """PPO's critic ranks ("critic rank N") in a placement group of their own (none without ppo);
    they go where the trainer ranks' placement says."""
    if config.algorithm.name != "ppo":
        return []
    n_ranks, resources = config.critic_ranks, actor_resources(config)
    group = cluster.reserve("critic", n_ranks, config.trainer.placement, resources)
    groups.append(group)
    env = cluster.actor_env(ds_accelerator(config))
    return [
        ActorInfo(
            "critic rank",
            r,
            CriticActor.options(
                **resources,
                max_restarts=0,
                scheduling_strategy=cluster.in_group(group, r),
            ).remote(config, r, n_ranks, env=env),
        )
        for r in range(n_ranks)
    ]


def describe_actors(actors: list[ActorInfo], run_dir: Path) -> None:
    """Each actor's node, pid and kernel facts into its ActorInfo, RUN_DIR/actors.json and the log."""
    for actor, facts in zip(actors, gather([(a, a.handle.describe.remote()) for a in actors])):
        actor.node_ip, actor.node_id, actor.pid = (
            facts["node_ip"],
            facts["node_id"],
            facts["pid"],
        )
        actor.facts, actor.env = facts["facts"], facts["env"]
    write_json_atomic(run_dir / "actors.json", [a.as_dict() for a in actors])
    for actor in actors:
        log.info("%s", actor.describe())


def check_kernel_parity(actors: list[ActorInfo]) -> None:
    """Bitwise parity needs the same kernels in every process: the described actors' kernel
    facts must all be equal, else ClusterError naming the first fact that differs."""
    cluster.check_same_kernels({a.describe(): a.facts for a in actors})


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
    starts += _critic_starts(*critics)
    return gather(_engine_starts(engines) + starts)[0]


def _critic_starts(critics: list[ActorInfo], resume_dir: str | None) -> list:
    """The critic ranks' remote start calls (their own rendezvous at critic rank 0's node);
    the caller gathers them with the other actors' starts."""
    if not critics:
        return []
    lead = critics[0]
    port = gather([(lead, lead.handle.free_port.remote())])[0]
    return [(c, c.handle.start.remote(lead.node_ip, port, resume_dir)) for c in critics]


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
