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
from rl_engine.executors.worker.micro_batches import MicroBatch, plan


def agree_on_batch(comm: Collectives, check: Callable[[], list[MicroBatch]]) -> list[MicroBatch]:
    """`check()` on this rank (its micro-batches), once every rank's check has passed.

    Also agreed: the micro-batch count. A rank with fewer micro-batches than another gets
    `None` entries appended (empty micro-batches: they still run a forward and a backward,
    so that every rank takes part in the same collectives).
    """
    try:
        micro, report = check(), None
    except Exception as err:  # any type: the other ranks must hear of it, not wait
        micro = None
        report = str(err) if isinstance(err, BatchError) else f"{type(err).__name__}: {err}"
    temperature = None if micro is None else micro[0].batch.logprob_temperature
    count = 0 if micro is None else len(micro)
    reports = comm.all_gather((report, temperature, count))
    bad = [(rank, text) for rank, (text, _, _) in enumerate(reports) if text is not None]
    if bad:
        raise BatchError(
            f"bad batch on rank(s) {', '.join(str(r) for r, _ in bad)}; no forward was run: "
            + "; ".join(f"rank {r}: {text}" for r, text in bad),
            ranks=tuple(r for r, _ in bad),
        )
    temps = [t for _, t, _ in reports]
    if len(set(temps)) > 1:
        raise BatchError(
            "the ranks' shards have different logprob_temperature ("
            + ", ".join(f"rank {r}: {t}" for r, t in enumerate(temps))
            + "); one step's shards must come from one batch, sampled at one temperature",
            ranks=tuple(r for r, t in enumerate(temps) if t != temps[0]),
        )
    most = max(n for _, _, n in reports)
    return micro + [None] * (most - len(micro))


def micro_batches(
    batch,
    *,
    vocab_size: int,
    micro_batch_size: int,
    device,
    sequences: int | None = None,
    weight_version: int | None = None,
    packing: bool = False,
    max_tokens: int = 0,
) -> list[MicroBatch]:
    """This rank's validated micro-batches on `device` (`micro_batches.plan`); raises BatchError.

    For a training step (`sequences` given: the shard's expected size) the shard must hold
    exactly that many sequences with a scored token in every micro-batch; with
    `weight_version` (parity 'strict') a batch sampled by another version is stale.
    """
    if not isinstance(batch, TrainBatch):
        raise BatchError(f"batch must be a TrainBatch, got {type(batch).__name__}")
    batch.validate(vocab_size)
    layout = dict(micro_batch_size=micro_batch_size, max_tokens=max_tokens, packing=packing)
    if sequences is not None:
        _check_step_shard(batch, sequences, weight_version, micro_batch_size, max_tokens)
    try:
        micro = plan(batch.to(device), **layout)
    except ValueError as err:  # a sequence longer than the token budget
        raise BatchError(f"{err} (trainer.max_tokens_per_micro_batch = {max_tokens})") from None
    if sequences is None:
        return micro
    for index, mb in enumerate(micro):
        if not bool(mb.batch.response_mask.any()):
            raise BatchError(
                f"micro-batch {index} (sequences {_listed(mb.sequences)}) "
                "scores no completion token"
            )
    return micro


def _check_step_shard(batch, sequences, weight_version, micro_batch_size, max_tokens) -> None:
    version = batch.weight_version
    if weight_version is not None and version is not None and version != weight_version:
        raise BatchError(
            f"stale batch: sampled by weight_version {version} but the worker's weights are "
            f"version {weight_version} (parity 'strict' trains on-policy batches only)"
        )
    if batch.num_sequences != sequences:
        how = (
            "sequences_per_step / num_ranks"
            if max_tokens
            else f"gradient_accumulation_steps x micro_batch_size = "
            f"{sequences // micro_batch_size} x {micro_batch_size}"
        )
        raise BatchError(
            f"this rank's shard has {batch.num_sequences} sequences; a step takes exactly "
            f"{how} = {sequences} per rank"
        )


def _listed(sequences: tuple[int, ...]) -> str:
    """'3..6' for a consecutive run, else '1, 4, 9'."""
    if sequences == tuple(range(sequences[0], sequences[-1] + 1)):
        return f"{sequences[0]}..{sequences[-1]}"
    return ", ".join(map(str, sequences))
