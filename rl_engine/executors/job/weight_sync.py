"""The step's weight sync: the trainer ranks' weights straight into every engine, never through the driver.

`connect_weight_sync` (once, at start): rank 0's `WeightManifest` is checked by every engine
process against its model (a mismatch names the key), each answers the plan of what it
receives, and every rank and engine process joins one process group (its store on rank
0's node). `sync_weights` (each step, and on resume): every rank sends its share, every
engine process receives in place; both sides must then agree on the version. A LoRA
policy's syncs after the first move only its adapters (`adapters_only`): the base is frozen.
`SyncSize` is what a sync moves, for the step's `weight_sync/bytes`: the distinct tensors
sent, each counted once, whatever the number of engines or tensor-parallel ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rl_engine.executors.job.faults import ActorFailure, ActorInfo, gather
from rl_engine.executors.worker.weights.weight_transport import adapter_names

log = logging.getLogger("rl_engine.job")


@dataclass(frozen=True, slots=True)
class SyncSize:
    """Bytes of the distinct tensors one sync moves: every tensor, or the adapters alone."""

    full: int
    adapters: int


def connect_weight_sync(trainers: list[ActorInfo], engines: list[ActorInfo]) -> SyncSize:
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
    return SyncSize(manifest.nbytes, manifest.nbytes_of(adapter_names(manifest)))


def sync_weights(
    trainers: list[ActorInfo], engines: list[ActorInfo], expected: int, adapters_only: bool = False
) -> int:
    """The trainer ranks' current weights (version `expected`) straight into every engine (the
    driver holds none), or only a LoRA policy's adapters; returns the version the engines now
    serve. An actor's death names the sync it happened in."""
    calls = [(t, t.handle.send_weights.remote(adapters_only)) for t in trainers]
    calls += [(e, e.handle.receive_weights.remote(adapters_only)) for e in engines]
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


def release_weights(engines: list[ActorInfo]) -> int:
    """Every engine releases the weights a full sync rewrites, until that sync (between a
    step's generation and its sync); returns the bytes released over all engines."""
    return sum(gather([(e, e.handle.release_weights.remote()) for e in engines]))
