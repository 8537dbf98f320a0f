"""`TrainerActor` (one DeepSpeed rank of the policy) and `CriticActor` (one of PPO's critic).

Each joins its DeepSpeed world at `start` (the policy's ranks one, the critic's ranks their
own) and wraps a worker of `executors.worker`; every worker call that runs collectives goes
through `_collective`, so a rank left alone in one fails after
`trainer.collective_timeout_s` with a TimeoutError that says so.
"""

from __future__ import annotations

import os
import time

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.job.actors.process import (
    TRAINER_MMAP_THRESHOLD_BYTES,
    JobActor,
    map_large_allocations,
    quiet_model_loading,
    release_free_heap,
    visible_gpu_index,
)
from rl_engine.executors.job.faults import first_line, weight_sync_kill_switch
from rl_engine.executors.worker.step.gradient_pages import release_gradient_partitions


class _DeepSpeedRank(JobActor):
    """What the policy's and the critic's DeepSpeed ranks share: their rank in their world."""

    def __init__(
        self, config: RunConfig, rank: int, world_size: int, env: dict[str, str] | None = None
    ):
        super().__init__(config, env)
        self.rank, self.world_size = rank, world_size


@ray.remote
class TrainerActor(_DeepSpeedRank):
    """One DeepSpeed rank; `start` joins the process group and builds the worker."""

    def start(self, master_addr: str, master_port: int, resume_from: str | None) -> None:
        _join_process_group(self.config, self.rank, self.world_size, master_addr, master_port)
        from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker

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
        # the ranks rest without their gradients while the engines generate
        dense = not self.worker.router.active
        release_gradient_partitions(self.worker.optimizer, dense=dense)
        release_free_heap()
        return {**metrics, "time/train_compute": seconds}

    def weight_manifest(self):
        return self.worker.weight_manifest()

    def connect_weight_group(self, address: str, port: int, size: int, plans: list) -> None:
        self._collective(
            "connect_weight_sync", self.worker.connect_weight_sync, address, port, size, plans
        )

    def send_weights(self, adapters_only: bool = False) -> dict:
        hook = weight_sync_kill_switch(f"trainer rank {self.rank}")
        send = self.worker.send_weights
        return self._collective("send_weights", send, on_bucket=hook, adapters_only=adapters_only)

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

    def verify_behaviour(self, batch) -> dict:
        return self._collective("verify_behaviour", self.worker.verify_behaviour, batch)

    def _collective(self, what: str, fn, *args, **kwargs):
        return _collective(f"trainer rank {self.rank}", self.config, what, fn, *args, **kwargs)


@ray.remote
class CriticActor(_DeepSpeedRank):
    """One DeepSpeed rank of PPO's critic, in the critic's own process group."""

    def start(self, master_addr: str, master_port: int, resume_from: str | None) -> None:
        _join_process_group(self.config, self.rank, self.world_size, master_addr, master_port)
        from rl_engine.executors.worker.critic.worker import CriticWorker

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


def _join_process_group(config: RunConfig, rank: int, world_size: int, addr: str, port: int):
    """This actor as rank `rank` of a DeepSpeed world (the trainer's, or the critic's own)."""
    from datetime import timedelta

    cuda = config.device == "cuda"
    map_large_allocations(TRAINER_MMAP_THRESHOLD_BYTES)  # before the worker's first tensor
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(visible_gpu_index() if cuda else rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    quiet_model_loading()
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
