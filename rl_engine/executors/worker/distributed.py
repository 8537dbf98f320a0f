"""Distributed setup of a DeepSpeed rank: environment, free ports, the accelerator, collectives.

Distributed setup comes from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT (single-process defaults when unset): gloo and DeepSpeed's CPU
accelerator on CPU, nccl on CUDA. deepspeed is imported lazily, after the
accelerator is chosen.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# Rendezvous ports are drawn from here (Ray's worker ports are 10002-19999 by default), less
# the kernel's ephemeral range if it overlaps.
RENDEZVOUS_PORTS = range(20000, 32768)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to binds of port 0."""
    try:
        low, high = map(int, Path(EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (for MASTER_PORT; "" = every interface of this node).

    The port is bound again later by another process (a TCPStore, a gloo rendezvous). Drawn
    at random outside the kernel's ephemeral range: a port of that range can be handed to any
    outgoing connection on the node in between (Ray and gRPC open many), and the rendezvous
    then failed with EADDRINUSE. Where no such port is free, the kernel picks one."""
    ephemeral, draw = ephemeral_ports(), random.SystemRandom()
    candidates = [p for p in RENDEZVOUS_PORTS if p not in ephemeral]
    for port in draw.sample(candidates, min(64, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class DistEnv:
    """This process's place in the job, from the torch.distributed environment variables."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read (and for a single process, default) RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT."""
        values = {}
        defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": os.environ.get("RANK", "0")}
        for key, default in defaults.items():
            raw = os.environ.get(key, default)
            if not raw.isdigit():
                raise ValueError(
                    f"environment variable {key} must be a non-negative int, got {raw!r}"
                )
            values[key] = int(raw)
        if values["WORLD_SIZE"] < 1 or values["RANK"] >= values["WORLD_SIZE"]:
            raise ValueError(
                f"RANK={values['RANK']} must be < WORLD_SIZE={values['WORLD_SIZE']} (>= 1)"
            )
        if values["WORLD_SIZE"] > 1 and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise ValueError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT in the environment")
        os.environ.update(
            RANK=str(values["RANK"]),
            WORLD_SIZE=str(values["WORLD_SIZE"]),
            LOCAL_RANK=str(values["LOCAL_RANK"]),
        )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])


def import_deepspeed(device: torch.device):
    """Import deepspeed with the accelerator matching `device`; return (deepspeed, backend name)."""
    wanted = "cpu" if device.type == "cpu" else "cuda"
    chosen = os.environ.setdefault("DS_ACCELERATOR", wanted)
    if chosen != wanted:
        raise ValueError(
            f"device {device} needs DS_ACCELERATOR={wanted}, but DS_ACCELERATOR={chosen}"
        )
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != wanted:
        raise ValueError(
            f"DeepSpeed already chose the {get_accelerator().device_name()!r} accelerator in this process; "
            f"device {device} needs {wanted!r}"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return deepspeed, ("gloo" if device.type == "cpu" else "nccl")


@dataclass(frozen=True, slots=True)
class Collectives:
    """The few collectives the worker uses; no-ops for a single rank."""

    rank: int
    world_size: int
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A CPU copy of `tensor` summed ('sum') or maxed ('max') over ranks."""
        if self.world_size == 1:
            return tensor
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.cpu()

    def all_gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank."""
        return bool(self.all_reduce(torch.tensor([float(flag)]), "max")[0] > 0)
