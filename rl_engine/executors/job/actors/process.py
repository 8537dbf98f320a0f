"""What every actor process of the job does for itself, and what every actor answers.

Devices (`config.device`): on cpu every actor asks Ray for one CPU; on cuda each also
asks for one GPU (`launch.actor_resources`), and Ray makes it the only GPU the actor
sees. An engine moves its model there and then patches it (the device picks the
kernels: triton on cuda); a trainer rank's LOCAL_RANK is the index of that GPU among
the visible ones, and the worker uses cuda:LOCAL_RANK.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.job import cluster


class JobActor:
    """What every actor of the job answers: where it runs and which kernels it computes with
    (`describe`, compared across actors before any model loads), and a free port of its node."""

    config: RunConfig

    def describe(self) -> dict:
        return {
            **cluster.node_identity(),
            "facts": cluster.kernel_facts(self.config.device),
        }

    def free_port(self) -> int:
        """A port free on every interface of this actor's node: the rendezvous of a group
        this actor leads (DeepSpeed's MASTER_PORT on rank 0, a TP engine's group on TP rank 0)."""
        from rl_engine.executors.worker.distributed import free_port

        return free_port(host="")


def visible_gpu_index() -> int:
    """Index, among the GPUs this process sees, of the one Ray assigned to this actor."""
    assigned = [str(i) for i in ray.get_gpu_ids()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if not assigned:
        raise RuntimeError("device is cuda but Ray assigned this actor no GPU")
    return visible.index(assigned[0]) if assigned[0] in visible else 0


def actor_device(config: RunConfig) -> str:
    """cuda:<the GPU Ray assigned> on cuda, else cpu."""
    return f"cuda:{visible_gpu_index()}" if config.device == "cuda" else "cpu"


def ds_accelerator(config: RunConfig) -> str:
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


def quiet_model_loading() -> None:
    """Model-loading chatter (transformers, GGUF dequantisation bars, DeepSpeed info) off in actors."""
    from rl_engine.models import quiet_loading

    quiet_loading()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
