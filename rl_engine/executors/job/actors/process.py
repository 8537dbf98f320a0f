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
    (`describe`, compared across actors before any model loads), and a free port of its node.

    `env` (`cluster.actor_env`: the DeepSpeed accelerator, the op cache, the kernels' ISA
    override, quiet loading) is set first thing in the constructor, before this process imports
    DeepSpeed, transformers or the kernels, which read it; the actor modules import none of them
    (tests/executors/job/actors/test_process.py). Set by Ray's `runtime_env` instead, it would
    cost every actor one more interpreter (Ray's setup_worker, ~0.5 CPU s; docs/platform-facts.md).
    """

    def __init__(self, config: RunConfig, env: dict[str, str] | None = None):
        os.environ.update(env or {})
        self.config = config

    def describe(self) -> dict:
        return {
            **cluster.node_identity(),
            "env": {key: os.environ.get(key) for key in cluster.ACTOR_ENV_KEYS},
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
def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune or trim
        return None


def _malloc_trim():
    return getattr(_glibc(), "malloc_trim", None)


# glibc's mallopt parameters (malloc.h) and the values the trainer ranks run with
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_THRESHOLD_BYTES = 32 << 20
# What the trainer ranks pass: the step's activations and the gradients of small layers are
# tensors of 128 KiB to 1 MiB (0.5B shape, 4 x 48 tokens: a hidden state is 336 KiB, an MLP
# activation 1.7 MiB), freed to the heap and left resident there between their uses; with
# their own pages a rank's peak RSS fell from 5506 to 5149 MiB. Each such allocation is now
# an mmap and munmap: its cost to the step was not told apart from the shared machine's noise
# (docs/platform-facts.md). 32 KiB was no lower (presumably glibc's M_MMAP_MAX, 65536
# mappings).
TRAINER_MMAP_THRESHOLD_BYTES = 128 << 10


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


def map_large_allocations(mmap_threshold: int = MMAP_THRESHOLD_BYTES) -> None:
    """Every allocation of `mmap_threshold` bytes or more (default 1 MiB) gets pages of its
    own (mmap), handed back to the OS when freed: glibc's dynamic mmap threshold otherwise
    rises to 32 MiB after the first large free, and the step's many freed tensors below that
    (activations, gathered layers, blocks of the LM-head gradient) stay resident on its heap.
    Measured on a 2-rank ZeRO-3 train step of the 0.5B-shaped model: a rank's peak RSS
    6321 -> 5711 MiB at 1 MiB (the trainer ranks pass `TRAINER_MMAP_THRESHOLD_BYTES`).
    Called before the worker is built; raises if glibc refuses a setting.
    """
    mallopt = getattr(_glibc(), "mallopt", None)
    if mallopt is None:
        return
    for param, value in (
        (M_MMAP_THRESHOLD, mmap_threshold),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    ):
        if mallopt(param, value) != 1:
            raise RuntimeError(f"glibc mallopt({param}, {value}) failed")


def quiet_model_loading() -> None:
    """Model-loading chatter (transformers, GGUF dequantisation bars, DeepSpeed info) off in actors."""
    from rl_engine.models import quiet_loading

    quiet_loading()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
