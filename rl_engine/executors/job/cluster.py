"""Where the job runs: connecting to Ray, placing actors, and checking that every node computes alike.

- `connect(config)`: with RAY_ADDRESS set (as `ray job submit` does for its entrypoint)
  the driver joins that cluster and declares no resources (a running cluster already has
  them); otherwise it starts a local cluster sized for the job.
- `reserve(...)`: trainer ranks and rollout engines each get a placement group
  (`pack`, `spread` or `strict_spread`), so a rank's node is decided before it starts and
  rank 0's node address can become MASTER_ADDR; a bundle is one actor's resources (one
  CPU, and one GPU when `device` is cuda).
- `kernel_facts()` / `check_same_kernels()`: bitwise parity needs the same kernel paths in
  every process, and those depend on the CPU's instruction set (AMX, AVX-512 BF16, vector
  width), the torch build and the backend. The driver collects them from every actor and
  refuses to run when they differ.
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger("rl_engine.job")

PLACEMENT_TIMEOUT_S = 120.0
# CPU flags that change which kernel (and so which bits) torch's GEMMs and our ops use.
KERNEL_CPU_FLAGS = (
    "amx_bf16",
    "amx_tile",
    "amx_int8",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "avx2",
    "fma",
)
# Passed to every actor: the DeepSpeed accelerator, quiet model loading, the op cache,
# the cpp kernels' instruction-set path when the driver forces one, the fault tests' switch.
# (No TQDM_DISABLE: tqdm reads it when imported, and Ray imports tqdm before an actor starts;
# the loading bars are turned off by `quiet_loading`.)
_DRIVER_ENV_KEYS = (
    "TORCH_EXTENSIONS_DIR",
    "RL_ENGINE_CPU_ISA",
    "RL_ENGINE_TEST_KILL_IN_WEIGHT_SYNC",
)
_QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
ACTOR_ENV_KEYS = ("DS_ACCELERATOR", *_DRIVER_ENV_KEYS, *_QUIET_ENV)


class ClusterError(RuntimeError):
    """The cluster cannot run the job as configured (resources, placement, mixed hardware)."""


def connect(config) -> bool:
    """Join RAY_ADDRESS's cluster or start a local one; True when this call did (and must shut down)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s (RAY_ADDRESS)", address)
        ray.init(address=address, log_to_driver=True)
    else:  # a private local cluster, never one another process started on this machine
        engines = config.rollout.num_engines * config.rollout.tensor_parallel_size
        actors = config.trainer.num_ranks + engines  # every TP rank is a process of its own
        if config.algorithm.name == "ppo":  # the critic's own ranks
            actors += config.critic_ranks
        gpus = actors if config.device == "cuda" else 0
        log.info("starting a local Ray cluster (%d CPUs, %d GPUs)", actors, gpus)
        ray.init(
            address="local",
            num_cpus=actors,
            num_gpus=gpus,
            include_dashboard=False,
            log_to_driver=True,
        )
    return True


def actor_env(ds_accelerator: str) -> dict[str, str]:
    """Environment variables every actor process gets."""
    env = {key: os.environ[key] for key in _DRIVER_ENV_KEYS if key in os.environ}
    return {**env, "DS_ACCELERATOR": ds_accelerator, **_QUIET_ENV}


def reserve(role: str, count: int, placement: str, resources: dict) -> PlacementGroup:
    """A placement group of `count` bundles of one actor's `resources` (num_cpus, num_gpus);
    a clear error when the cluster cannot hold it."""
    bundle = {"CPU": float(resources["num_cpus"])}
    if resources.get("num_gpus"):
        bundle["GPU"] = float(resources["num_gpus"])
    group = placement_group([dict(bundle) for _ in range(count)], strategy=placement.upper())
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        raise ClusterError(
            f"{role}.placement {placement!r}: the cluster cannot place {count} {role} actor(s) of "
            f"{bundle} within {PLACEMENT_TIMEOUT_S:.0f} s ({nodes} node(s), available "
            f"{ray.available_resources()})"
        )
    return group


def release(groups: list[PlacementGroup]) -> None:
    """Give the job's placement groups back to the cluster."""
    for group in groups:
        remove_placement_group(group)


def in_group(group, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )


def node_identity() -> dict:
    """This actor's node address, node id and process id (for placement and fault messages)."""
    context = ray.get_runtime_context()
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": context.get_node_id(),
        "pid": os.getpid(),
    }


def kernel_facts(device: str) -> dict:
    """The facts that decide which kernels run here (and so the bits of every logprob)."""
    import torch

    from rl_engine import kernels

    present = kernels.cpu_flags()  # /proc/cpuinfo's flags, read once per process
    facts = {
        "torch": torch.__version__,
        "device": device,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": " ".join(flag for flag in KERNEL_CPU_FLAGS if flag in present),
    }
    # the backend's own numerics (cpp: its version and bf16 dot flavour)
    facts.update({f"kernels.{k}": v for k, v in kernels.kernel_facts(device).items()})
    if device == "cuda" and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        facts["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return facts


def check_same_kernels(facts: dict[str, dict]) -> None:
    """Raise ClusterError naming the first fact that differs between two actors ({actor name: facts})."""
    names = list(facts)
    reference = names[0]
    for name in names[1:]:
        for key in sorted(set(facts[reference]) | set(facts[name])):
            mine, theirs = facts[reference].get(key), facts[name].get(key)
            if mine != theirs:
                raise ClusterError(
                    f"kernel paths differ: {key} is {mine!r} on {reference} but {theirs!r} on "
                    f"{name}; bitwise parity needs the same kernels on both sides (run every "
                    "rank and engine on the same CPU type, torch version and backend)"
                )
