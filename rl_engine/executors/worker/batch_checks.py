"""Before any forward: every rank checks its shard, and the ranks agree on the outcome.

A rank whose check fails, with an exception of any type, must not leave the
others waiting in the step's first collective: the outcome of every rank's check
is all-gathered, and a failure anywhere is a `BatchError` on every rank naming
the rank(s) and why. The shards must also agree on `logprob_temperature`.
"""

from __future__ import annotations

from collections.abc import Callable

from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.errors import BatchError


def agree_on_batch(comm: Collectives, check: Callable[[], list[TrainBatch]]) -> list[TrainBatch]:
    """`check()` on this rank (its micro-batches), once every rank's check has passed."""
    try:
        micro, report = check(), None
    except Exception as err:  # any type: the other ranks must hear of it, not wait
        micro = None
        report = str(err) if isinstance(err, BatchError) else f"{type(err).__name__}: {err}"
    temperature = None if micro is None else micro[0].logprob_temperature
    reports = comm.all_gather((report, temperature))
    bad = [(rank, text) for rank, (text, _) in enumerate(reports) if text is not None]
    if bad:
        raise BatchError(
            f"bad batch on rank(s) {', '.join(str(r) for r, _ in bad)}; no forward was run: "
            + "; ".join(f"rank {r}: {text}" for r, text in bad),
            ranks=tuple(r for r, _ in bad),
        )
    temps = [t for _, t in reports]
    if len(set(temps)) > 1:
        raise BatchError(
            "the ranks' shards have different logprob_temperature ("
            + ", ".join(f"rank {r}: {t}" for r, t in enumerate(temps))
            + "); one step's shards must come from one batch, sampled at one temperature",
            ranks=tuple(r for r, t in enumerate(temps) if t != temps[0]),
        )
    return micro


def micro_batches(
    batch,
    *,
    vocab_size: int,
    micro_batch_size: int,
    device,
    accumulation_steps: int | None = None,
    weight_version: int | None = None,
) -> list[TrainBatch]:
    """This rank's validated micro-batches on `device`; raises BatchError.

    For a training step (`accumulation_steps` given) the shard must hold exactly
    accumulation_steps x micro_batch_size sequences with a scored token in every
    micro-batch; with `weight_version` (parity 'strict') a batch sampled by another
    version is stale.
    """
    if not isinstance(batch, TrainBatch):
        raise BatchError(f"batch must be a TrainBatch, got {type(batch).__name__}")
    batch.validate(vocab_size)
    if accumulation_steps is None:
        return batch.to(device).micro_batches(micro_batch_size)
    version = batch.weight_version
    if weight_version is not None and version is not None and version != weight_version:
        raise BatchError(
            f"stale batch: sampled by weight_version {version} but the worker's weights are "
            f"version {weight_version} (parity 'strict' trains on-policy batches only)"
        )
    if batch.num_sequences != accumulation_steps * micro_batch_size:
        raise BatchError(
            f"this rank's shard has {batch.num_sequences} sequences; a step takes exactly "
            f"gradient_accumulation_steps x micro_batch_size = {accumulation_steps} x "
            f"{micro_batch_size} per rank"
        )
    micro = batch.to(device).micro_batches(micro_batch_size)
    for index, mb in enumerate(micro):
        if not bool(mb.response_mask.any()):
            first = index * micro_batch_size
            raise BatchError(
                f"micro-batch {index} (sequences {first}..{first + micro_batch_size - 1}) "
                "scores no completion token"
            )
    return micro
