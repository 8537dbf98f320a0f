"""Weights from the trainer ranks straight into the rollout engines: the weight group and the sender.

The weight group is a torch.distributed process group of its own, beside
DeepSpeed's default one: group ranks 0 .. W-1 are the W trainer ranks (the
senders, in DeepSpeed rank order), the receivers (rollout engines, or each
tensor-parallel rank of one) follow. It is built directly from a `TCPStore`
(hosted by trainer rank 0) and a `ProcessGroupGloo` (cpu) or
`ProcessGroupNCCL` (cuda) backend, the way verl and OpenRLHF build theirs:

- `init_process_group` makes the one default group of a process, which in a
  trainer rank is DeepSpeed's, and `new_group` only subdivides that one; the
  engines are not in it;
- Ray's collective library would bring Ray into the worker (which must not
  import it) and, on CPU, needs pygloo, which nothing here installs.

What a rank sends (`policy_manifest`): under ZeRO-3 each rank sends its own
partition of every parameter (`param.ds_tensor`: flat elements
[r * p, (r + 1) * p) of it, p = ds_tensor.ds_numel), so nothing is gathered and
the ranks send in parallel; ranks that hold a tensor whole (ZeRO-0/1/2,
buffers) send near-equal flat ranges of it. The pieces and the header are
`rl_engine.rollout.weight_pieces` / `weight_receiver`'s: the receiving side
lives in the rollout layer, which this module only imports from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.patching.lora import is_adapter_name
from rl_engine.rollout.weight_pieces import plan_pieces, source_elements
from rl_engine.rollout.weight_plan import (
    TensorSpec,
    WeightManifest,
    WeightPlan,
    dtype_name,
    even_sources,
    sync_digest,
)
from rl_engine.rollout.weight_receiver import HEADER_TAG, SyncHeader, wait_for

logger = logging.getLogger(__name__)

STORE_PREFIX = "rl_engine/weights"


class WeightGroup:
    """The weight group's backend, seen from one process: `send` / `recv` of tensor lists by group rank.

    `connect` blocks until all `size` processes have joined (or `timeout` passes). Every
    operation fails after `timeout` instead of hanging, and at once when a peer's process
    is gone (gloo: "Connection closed by peer").
    """

    def __init__(self, backend, store, rank: int, size: int):
        self.backend, self._store, self.rank, self.size = backend, store, rank, size

    @classmethod
    def connect(
        cls, address: str, port: int, rank: int, size: int, device: str, timeout_s: float
    ) -> WeightGroup:
        from torch.distributed import PrefixStore, TCPStore

        if not 0 <= rank < size:
            raise ValueError(f"weight group rank {rank} must be in [0, {size})")
        timeout = timedelta(seconds=timeout_s)
        store = TCPStore(address, port, size, rank == 0, timeout=timeout)
        prefixed = PrefixStore(STORE_PREFIX, store)
        return cls(_backend(prefixed, rank, size, torch.device(device), timeout), store, rank, size)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        return self.backend.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int):
        return self.backend.recv(tensors, src, tag)

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.backend = None


def _backend(store, rank: int, size: int, device: torch.device, timeout: timedelta):
    """gloo for CPU tensors, NCCL for CUDA ones (one process group each, not the default one)."""
    if device.type == "cpu":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, size, timeout)
    if device.type == "cuda":  # not run here (no GPU on these machines)
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"weight group: no backend for device {device}")


def policy_tensors(policy: nn.Module) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Every tensor of the policy's state dict once, with all its names (tied names share one)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in policy.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return [(tuple(names), tensor) for names, tensor in groups.values()]


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's shape, also while ZeRO-3 has it partitioned (its `ds_shape`)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def policy_manifest(policy: nn.Module, *, zero3: bool, world_size: int) -> WeightManifest:
    """What the W trainer ranks send: ZeRO-3 partitions where there are, even splits elsewhere.

    Every rank computes the same manifest (ZeRO-3's partition size is the same on all ranks).
    """
    specs = []
    for names, tensor in policy_tensors(policy):
        shape = full_shape(tensor)
        numel = _numel(shape)
        if zero3 and getattr(tensor, "ds_tensor", None) is not None:
            _check_zero3_group(names[0], tensor, world_size)
            part = int(tensor.ds_tensor.ds_numel)  # rank r holds [r * part, (r + 1) * part)
            bounds = [min(numel, r * part) for r in range(world_size)] + [numel]
            sources = tuple(zip(bounds[:-1], bounds[1:]))
        else:
            sources = even_sources(numel, world_size)
        specs.append(TensorSpec(names[0], shape, dtype_name(tensor.dtype), sources, names[1:]))
    return WeightManifest(tuple(specs), world_size)


def _check_zero3_group(name: str, param, world_size: int) -> None:
    import torch.distributed as dist

    group = getattr(param, "ds_process_group", None)
    size = dist.get_world_size(group=group)
    if size != world_size:
        raise ValueError(
            f"{name!r} is partitioned over {size} ranks, not the {world_size} data-parallel ranks: "
            "ZeRO-3 with a partition group of its own (hpZ, MiCS) is not supported by the weight sync"
        )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def held_ranges(policy: nn.Module, manifest: WeightManifest, rank: int, zero3: bool):
    """Per manifest tensor, the 1-D tensor holding this rank's range of it (a view, no copy)."""
    tensors = [tensor for _, tensor in policy_tensors(policy)]
    held = []
    for spec, tensor in zip(manifest.tensors, tensors):
        lo, hi = spec.sources[rank]
        if zero3 and getattr(tensor, "ds_tensor", None) is not None:
            held.append(tensor.ds_tensor.detach().view(-1)[: hi - lo])
        else:
            held.append(tensor.detach().reshape(-1)[lo:hi])
    return held


def adapter_names(manifest: WeightManifest) -> list[str]:
    """The manifest's LoRA adapter tensors (all a sync moves once the frozen base is there)."""
    return [spec.name for spec in manifest.tensors if is_adapter_name(spec.name)]


def weight_senders(
    manifest: WeightManifest, plans: list[WeightPlan], sender: int, bucket_bytes: int, lora: bool
) -> dict[str, WeightSender]:
    """This rank's senders by scope: 'full' (every tensor) and, for a LoRA policy,
    'adapters' (the receivers' plans restricted to the adapters)."""
    senders = {"full": WeightSender(manifest, plans, sender, bucket_bytes)}
    if lora:
        names = adapter_names(manifest)
        partial = [plan.only(names) for plan in plans]
        senders["adapters"] = WeightSender(manifest, partial, sender, bucket_bytes)
    return senders


def agree_on_group(
    manifest: WeightManifest, plans: list[WeightPlan], group_size: int, comm: Collectives
) -> None:
    """Before joining a weight group of `group_size` (the trainer ranks, then one per receiver
    plan): the plans fill it and every trainer rank computed the same manifest (collective)."""
    if len(plans) != group_size - comm.world_size:
        raise ValueError(
            f"{len(plans)} receiver plans for a weight group of {group_size} with "
            f"{comm.world_size} trainer ranks"
        )
    theirs = comm.all_gather(manifest.to_json())
    if any(other != theirs[0] for other in theirs):
        raise RuntimeError("trainer ranks computed different weight manifests")


class WeightSender:
    """One trainer rank's side of the weight group: the pieces it owes each receiver."""

    def __init__(
        self,
        manifest: WeightManifest,
        plans: list[WeightPlan],
        sender: int,
        bucket_bytes: int,
    ):
        for plan in plans:
            plan.check(manifest)
        self.manifest, self.plans, self.sender = manifest, plans, sender
        self.bucket_bytes = bucket_bytes
        self._buckets = [
            plan_pieces(manifest, plan, q, bucket_bytes) for q, plan in enumerate(plans)
        ]
        self._digests = [sync_digest(manifest, plan, bucket_bytes) for plan in plans]

    def send(
        self,
        channel,
        held: list[torch.Tensor],
        version: int,
        on_bucket: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """Send this rank's pieces of version `version` to every receiver; sender 0 first
        sends each receiver the header. Returns {"bytes", "seconds"} of this rank."""
        started, sent = time.perf_counter(), 0
        first = self.manifest.num_senders
        if self.sender == 0:
            headers = [
                SyncHeader(version, digest, sum(len(b) for b in buckets)).encode()
                for digest, buckets in zip(self._digests, self._buckets)
            ]
            works = [channel.send([h], first + q, HEADER_TAG) for q, h in enumerate(headers)]
            for q, work in enumerate(works):
                wait_for(work, f"weight sync to version {version}: the header to receiver {q}")
        with torch.no_grad():
            for number in range(max((len(b) for b in self._buckets), default=0)):
                payload, works = [], []
                for q, buckets in enumerate(self._buckets):
                    if number >= len(buckets):
                        continue
                    slices = self.plans[q].slices
                    for piece in buckets[number]:
                        if piece.sender != self.sender:
                            continue
                        spec = self.manifest.tensors[piece.tensor]
                        data = source_elements(
                            held[piece.tensor], spec, self.sender, slices[spec.name], piece
                        )
                        payload.append(data)  # alive until its send completes
                        works.append((q, spec.name, channel.send([data], first + q, piece.index)))
                        sent += data.numel() * data.element_size()
                for q, name, work in works:
                    wait_for(
                        work, f"weight sync to version {version}: sending {name!r} to receiver {q}"
                    )
                if on_bucket is not None:
                    on_bucket(version, number)
        return {"bytes": float(sent), "seconds": time.perf_counter() - started}
